// csrc/emu/emu_errors.cpp — how the SIMT emulator reports (csrc/emu/README.md): the text of an
// execution error (which kernel, block, thread, lanes and source lines), stopping a launch at its
// first error, device faults, and the CUDA runtime's error and attribute API (a configuration
// error sets cudaGetLastError(), as CUDA does).
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "emu_internal.h"

namespace emu {
namespace internal {
namespace {
thread_local cudaError_t g_last_error = cudaSuccess;
thread_local std::string g_last_error_text;
thread_local cudaError_t g_last_error_text_code = cudaSuccess;
}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kBarrier: return "__syncthreads";
    case Op::kActiveMask: return "__activemask";
    case Op::kSyncWarp: return "__syncwarp";
    case Op::kShflIdx: return "__shfl_sync";
    case Op::kShflUp: return "__shfl_up_sync";
    case Op::kShflDown: return "__shfl_down_sync";
    case Op::kShflXor: return "__shfl_xor_sync";
    case Op::kBallot: return "__ballot_sync";
    case Op::kAny: return "__any_sync";
    case Op::kAll: return "__all_sync";
    case Op::kMatchAny: return "__match_any_sync";
    case Op::kMatchAll: return "__match_all_sync";
    case Op::kReduceAdd: return "__reduce_add_sync";
    case Op::kReduceMin: return "__reduce_min_sync";
    case Op::kReduceMax: return "__reduce_max_sync";
    case Op::kReduceAnd: return "__reduce_and_sync";
    case Op::kReduceOr: return "__reduce_or_sync";
    case Op::kReduceXor: return "__reduce_xor_sync";
  }
  return "?";
}

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof(buf), f, ap);
  va_end(ap);
  return buf;
}

std::string short_path(const char* path) {
  const std::string file = path;
  for (const char* dir : {"/csrc/", "/tests/"})
    if (const size_t cut = file.rfind(dir); cut != std::string::npos) return file.substr(cut + 1);
  return file;
}

std::string site_str(const std::source_location& s) {
  return fmt("%s:%u:%u", short_path(s.file_name()).c_str(), static_cast<unsigned>(s.line()),
             static_cast<unsigned>(s.column()));
}

bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

std::string ranges(const std::vector<int>& xs) {
  std::string out;
  for (size_t i = 0; i < xs.size();) {
    size_t j = i;
    while (j + 1 < xs.size() && xs[j + 1] == xs[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? std::to_string(xs[i]) : std::to_string(xs[i]) + "-" + std::to_string(xs[j]);
    i = j + 1;
  }
  return out;
}

std::string who(const Thread& t) {
  const ThreadIds& i = t.ids;
  return fmt("block (%u,%u,%u) thread (%u,%u,%u) [warp %d lane %d]", i.block_idx.x, i.block_idx.y, i.block_idx.z,
             i.thread_idx.x, i.thread_idx.y, i.thread_idx.z, t.warp, t.lane);
}

std::string kernel_str() {
  const LaunchInfo& in = *g_launch->info;
  return fmt("kernel %s launched at %s:%d with grid (%u,%u,%u) block (%u,%u,%u)", in.kernel,
             short_path(in.file).c_str(), in.line,
             in.grid.x, in.grid.y, in.grid.z, in.block.x, in.block.y, in.block.z);
}

void record_error(const std::string& what) {
  if (g_launch->failed) return;
  g_launch->failed = true;
  g_launch->error = "specrt emu: " + what + "\n  in " + kernel_str() + "\n  order: " + order_name();
}

[[noreturn]] void fail_here(const std::string& what) {
  record_error(what);
  g_cur->st = St::kDone;
  yield_to_scheduler(true);
  std::abort();  // never resumed
}

std::string describe_blocked() {
  std::string out;
  const int warps = (g_launch->nthreads + kWarp - 1) / kWarp;
  for (int w = 0; w < warps; ++w) {
    // group lanes by state / site
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    for (int l = 0; l < kWarp; ++l) {
      const Thread* t = lane_thread(w, l);
      if (t == nullptr) continue;
      std::string key;
      if (t->st == St::kDone) key = "exited";
      else if (t->op == Op::kBarrier) key = "wait at __syncthreads (" + site_str(t->site) + ")";
      else key = fmt("wait at %s (%s, mask 0x%08x)", op_name(t->op), site_str(t->site).c_str(), t->mask);
      auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == key; });
      if (it == groups.end()) groups.push_back({key, {l}});
      else it->second.push_back(l);
    }
    if (groups.size() == 1 && groups[0].first == "exited") continue;
    out += fmt("\n  warp %d:", w);
    for (auto& g : groups) out += " lanes " + ranges(g.second) + " " + g.first + ";";
  }
  return out;
}

void set_launch_error(cudaError_t e, const std::string& text) {
  g_last_error = e;
  g_last_error_text = "specrt emu: " + text;
  g_last_error_text_code = e;
}

}  // namespace internal

using namespace internal;

void device_fault(const char* what) {
  if (g_cur == nullptr) throw std::runtime_error(std::string("specrt emu: ") + what);
  fail_here(std::string(what) + "\n  " + who(*g_cur));
}

void host_use(const char* what) {
  throw std::runtime_error(std::string("specrt emu: ") + what + " used outside a kernel");
}

cudaError_t set_func_attribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > kSharedOptinLimit - 0) {
      set_launch_error(cudaErrorInvalidValue, fmt("cudaFuncSetAttribute: %d bytes of dynamic shared memory exceed "
                                                  "the device's %d", value, kSharedOptinLimit));
      return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    g_func_smem[func] = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  set_launch_error(cudaErrorInvalidValue, fmt("cudaFuncSetAttribute: attribute %d is not emulated", attr));
  return cudaErrorInvalidValue;
}

}  // namespace emu

cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::internal::g_last_error;
  emu::internal::g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return emu::internal::g_last_error; }
const char* cudaGetErrorString(cudaError_t error) {
  if (error == cudaSuccess) return "no error";
  if (error == emu::internal::g_last_error_text_code) return emu::internal::g_last_error_text.c_str();
  return cudaGetErrorName(error);
}
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  (void)device;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: {
      static const int sms = [] {
        const char* e = std::getenv("SPECRT_EMU_SM_COUNT");
        return e != nullptr && std::atoi(e) > 0 ? std::atoi(e) : 132;  // H100 / H200 SXM
      }();
      *value = sms;
      return cudaSuccess;
    }
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 232448; return cudaSuccess;
  }
  emu::internal::g_last_error = emu::internal::g_last_error_text_code = cudaErrorInvalidValue;
  emu::internal::g_last_error_text = "specrt emu: cudaDeviceGetAttribute: attribute not emulated";
  return cudaErrorInvalidValue;
}
