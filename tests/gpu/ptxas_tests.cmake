# The build's ptxas checks fire: a kernel that spills registers, or that keeps an array in local
# memory, built with the library's CUDA flags (DATTN_WARNINGS: -Werror=all-warnings and ptxas's
# --warn-on-spills, --warn-on-local-memory-usage) must fail to build, with a ptxas error that names
# it. Included by tests/gpu/CMakeLists.txt; needs nvcc, no GPU (label unit).
#
# One probe target (tests/gpu/ptxas_probe.cu) per kind and per architecture of the build, out of
# the default build since it must fail; each test builds one through the build system, so that
# the flags, the launcher and the architecture are those the kernels are built with. The tests
# share the build folder's build tool, hence the lock: one runs at a time (about 2 s each).
foreach(arch ${CMAKE_CUDA_ARCHITECTURES})
  foreach(probe spills local_array)
    set(target ptxas_probe_${probe}_${arch})
    add_library(${target} OBJECT EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/ptxas_probe.cu)
    target_compile_definitions(${target} PRIVATE DATTN_PTXAS_PROBE_${probe})
    target_compile_options(${target} PRIVATE ${DATTN_WARNINGS})
    set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES ${arch})
    add_test(NAME ${target}
             COMMAND ${CMAKE_COMMAND} --build ${CMAKE_BINARY_DIR} --target ${target}
                     --config $<CONFIG>)
    # Passes on the error alone (ctest then ignores the exit status): a build that succeeds, or
    # fails for another reason, prints no such line.
    if(probe STREQUAL "spills")
      set(expect "ptxas error *: Registers are spilled to local memory in function '[^']*probe_spills")
    else()
      set(expect "ptxas error *: Local memory used for function '[^']*probe_local_array")
    endif()
    set_tests_properties(${target} PROPERTIES PASS_REGULAR_EXPRESSION "${expect}" TIMEOUT 60
                         LABELS unit RESOURCE_LOCK dattn_build_tool)
  endforeach()
endforeach()
