# kernels/movement on its host backend (Thrust OMP): every operation against the plain loop it
# replaced. Included by tests/CMakeLists.txt.
dattn_add_unit_test(test_movement test_movement.cpp)
