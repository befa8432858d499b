// How a rank waiting for its peers tells a dead peer from a slow one. The kernel's Waiter
// (protocol.cpp: process_alive, check_alive) and the pure-torch path's wait
// (arfuse.backends.shm.segment.alive, ShmWorkspace._wait, which read these lines through
// arfuse.ctables) follow the same rule:
//
//   while a wait lasts, at most every kLookS, each silent peer's /proc/<pid>/stat is read
//   (when every rank's process was visible at creation); the peer is dead when that file
//   cannot be read, when its start time (field kStatStartField, clock ticks since boot) is
//   not the one the peer published in the segment's identity line (a pid can be reused), or
//   when its state (field kStatStateField) is zombie or dead ('Z', 'X').
#pragma once

namespace arfuse {
namespace liveness {

constexpr double kLookS = 10e-3;
constexpr int kStatStateField = 3;
constexpr int kStatStartField = 22;

}  // namespace liveness
}  // namespace arfuse
