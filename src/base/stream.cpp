// The thread-local current stream of src/base/stream.h.
#include "src/base/stream.h"

namespace dattn {

namespace {
thread_local StreamHandle current = nullptr;
}  // namespace

StreamHandle current_stream() {
  return current;
}

StreamScope::StreamScope(StreamHandle stream) : previous_(current) {
  current = stream;
}

StreamScope::~StreamScope() {
  current = previous_;
}

}  // namespace dattn
