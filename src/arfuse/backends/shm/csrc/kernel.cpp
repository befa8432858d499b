// The kernel's one translation unit. The compiler then reads torch's headers, most of a build's
// time, once instead of once per file, and can inline across files. Every other .cpp beside
// this one is included here exactly once (build.py refuses to build otherwise), so no two of
// them may define the same name at file scope in an anonymous namespace or as static.
#include "bindings.cpp"
#include "comm.cpp"
#include "comm_checks.cpp"
#include "comm_life.cpp"
#include "finish.cpp"
#include "moe.cpp"
#include "operators.cpp"
#include "protocol.cpp"
