// The emulated dispatch: included after the translated kernel (emulator.py), it binds a launch's
// buffers and function constants and runs every thread of the grid on the CPU, one at a time.
//
//   runner --describe            JSON: entries, their parameters (with C++-resolved element types)
//                                and the function constants the source declares
//   runner REQUEST RESPONSE      one launch; buffers are allocated with their exact sizes, so
//                                AddressSanitizer reports any access past one of them; a buffer
//                                bound at a byte offset (a strided view's first element) gives the
//                                kernel that address, as setBuffer:offset: does
//
// Threads run threadgroup by threadgroup (edge groups clipped to the grid, as dispatch_threads does),
// in forward, reverse or seeded-shuffled order; kernels that call threadgroup_barrier run the threads
// of a group as fibers that all meet at each barrier. Errors print "metal_emu: ..." and exit 2.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__) || defined(__has_feature)
#if defined(__SANITIZE_ADDRESS__)
#define METAL_EMU_ASAN 1
#elif __has_feature(address_sanitizer)
#define METAL_EMU_ASAN 1
#endif
#endif
#ifdef METAL_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace metal_emu {

[[noreturn]] inline void fail(const std::string& msg) {
  std::fprintf(stderr, "metal_emu: %s\n", msg.c_str());
  std::fflush(stderr);
  std::exit(2);
}

// ---------------------------------------------------------------------------- entries
enum ParamKind {
  kBuffer,
  kThreadPositionInGrid,
  kThreadPositionInThreadgroup,
  kThreadgroupPositionInGrid,
  kThreadsPerThreadgroup,
  kThreadsPerGrid,
  kThreadgroupsPerGrid,
  kThreadIndexInThreadgroup,
};
struct Param {
  int kind;
  int index;  // buffer index for kBuffer
  const char* name;
};

template <typename T> const char* elem_name() { return "other"; }
template <> inline const char* elem_name<float>() { return "float"; }
template <> inline const char* elem_name<half>() { return "half"; }
template <> inline const char* elem_name<bfloat>() { return "bfloat"; }
template <> inline const char* elem_name<int>() { return "int"; }
template <> inline const char* elem_name<uint>() { return "uint"; }
template <> inline const char* elem_name<short>() { return "short"; }
template <> inline const char* elem_name<ushort>() { return "ushort"; }
template <> inline const char* elem_name<char>() { return "char"; }
template <> inline const char* elem_name<signed char>() { return "char"; }
template <> inline const char* elem_name<uchar>() { return "uchar"; }
template <> inline const char* elem_name<bool>() { return "bool"; }
template <> inline const char* elem_name<long>() { return "long"; }
template <> inline const char* elem_name<unsigned long>() { return "ulong"; }
template <> inline const char* elem_name<int4>() { return "int4"; }  // a strided buffer's strides

inline uint3 id_of(int kind, const ThreadIds& id) {
  switch (kind) {
    case kThreadPositionInGrid: return id.thread_position_in_grid;
    case kThreadPositionInThreadgroup: return id.thread_position_in_threadgroup;
    case kThreadgroupPositionInGrid: return id.threadgroup_position_in_grid;
    case kThreadsPerThreadgroup: return id.threads_per_threadgroup;
    case kThreadsPerGrid: return id.threads_per_grid;
    case kThreadgroupsPerGrid: return id.threadgroups_per_grid;
    case kThreadIndexInThreadgroup: return uint3(id.thread_index_in_threadgroup, 0u, 0u);
  }
  fail("internal: bad parameter kind");
}

// One argument of parameter type P: buffers are pointers or references into the bound buffer,
// position attributes are values.
template <typename P>
inline P arg(const Param& p, void* const* buffers, const ThreadIds& id) {
  if constexpr (std::is_pointer<P>::value) {
    return static_cast<P>(buffers[p.index]);
  } else if constexpr (std::is_reference<P>::value) {
    return *static_cast<std::remove_reference_t<P>*>(buffers[p.index]);
  } else {
    return pos_as<P>(id_of(p.kind, id));
  }
}

template <typename F> struct Signature;
template <typename... P>
struct Signature<void (*)(P...)> {
  static constexpr int arity = sizeof...(P);
  template <auto F, size_t... I>
  static void call(void* const* b, const ThreadIds& id, const Param* params, std::index_sequence<I...>) {
    F(arg<P>(params[I], b, id)...);
  }
  template <typename Q>
  static void describe_one(std::string& out, const Param& p) {
    using Bare = std::remove_reference_t<Q>;
    using Pointee = std::conditional_t<std::is_pointer<Bare>::value, std::remove_pointer_t<Bare>, Bare>;
    const bool is_buffer = std::is_pointer<Q>::value || std::is_reference<Q>::value;
    if (is_buffer != (p.kind == kBuffer)) {
      fail(std::string("parameter ") + p.name + (is_buffer ? " is a pointer/reference but not a [[buffer(n)]]"
                                                           : " is a [[buffer(n)]] but not a pointer or reference"));
    }
    char line[256];
    std::snprintf(line, sizeof line,
                  "{\"name\": \"%s\", \"kind\": %d, \"index\": %d, \"elem\": \"%s\", \"const\": %s, \"ref\": %s}",
                  p.name, p.kind, p.index, elem_name<std::remove_cv_t<Pointee>>(),
                  std::is_const<Pointee>::value ? "true" : "false", std::is_reference<Q>::value ? "true" : "false");
    if (!out.empty()) out += ", ";
    out += line;
  }
  static std::string describe(const Param* params) {
    std::string out;
    int i = 0;
    (describe_one<P>(out, params[i++]), ...);
    return out;
  }
};

struct EntryDef {
  const char* name;
  void (*invoke)(void* const* buffers, const ThreadIds& id, const Param* params);
  std::string (*describe)(const Param* params);
  const Param* params;
  int n_params;
  bool uses_barriers;
  int max_threads;  // [[max_total_threads_per_threadgroup(n)]], 0 if absent
};

template <auto F>
void invoke(void* const* buffers, const ThreadIds& id, const Param* params) {
  using S = Signature<decltype(F)>;
  S::template call<F>(buffers, id, params, std::make_index_sequence<S::arity>{});
}

template <auto F>
EntryDef make_entry(const char* name, const Param* params, int n_params, bool uses_barriers, int max_threads) {
  using S = Signature<decltype(F)>;
  if (S::arity != n_params) fail(std::string(name) + ": parameter count differs from the parsed source");
  return {name, &invoke<F>, &S::describe, params, n_params, uses_barriers, max_threads};
}

// ---------------------------------------------------------------------------- threadgroup memory
struct TgSlot {
  void* ptr;
  size_t size;
};
inline std::map<std::pair<int, size_t>, TgSlot>& tg_slots() {
  static std::map<std::pair<int, size_t>, TgSlot> slots;
  return slots;
}
void* threadgroup_storage(int id, size_t size, size_t align) {
  auto& slot = tg_slots()[{id, size}];
  if (slot.ptr == nullptr) {
    slot.ptr = ::operator new(size, std::align_val_t(align));  // exact size: ASan sees overruns
    slot.size = size;
    std::memset(slot.ptr, 0xFF, size);
  }
  return slot.ptr;
}
inline void poison_threadgroup_memory() {
  for (auto& kv : tg_slots()) std::memset(kv.second.ptr, 0xFF, kv.second.size);
}

// ---------------------------------------------------------------------------- fibers (barriers)
enum FiberState { kReady, kAtBarrier, kDone };
struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  FiberState state = kReady;
  int site = -1;
  ThreadIds id;
  void* fake_stack = nullptr;
};
constexpr size_t kFiberStack = 512 * 1024;

struct Scheduler {
  ucontext_t main_ctx;
  std::vector<Fiber> fibers;
  int current = -1;
  const EntryDef* entry = nullptr;
  void* const* buffers = nullptr;
  void* main_fake_stack = nullptr;
  const void* main_bottom = nullptr;
  size_t main_size = 0;
};
inline Scheduler& sched() {
  static Scheduler s;
  return s;
}

inline void start_switch(void** save, const void* bottom, size_t size) {
#ifdef METAL_EMU_ASAN
  __sanitizer_start_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}
inline void finish_switch(void* save, const void** bottom, size_t* size) {
#ifdef METAL_EMU_ASAN
  __sanitizer_finish_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}

inline void fiber_main(int index) {
  Scheduler& s = sched();
  finish_switch(nullptr, &s.main_bottom, &s.main_size);
  Fiber& f = s.fibers[index];
  s.entry->invoke(s.buffers, f.id, s.entry->params);
  f.state = kDone;
  start_switch(nullptr, s.main_bottom, s.main_size);  // this fiber ends: its fake stack goes
  swapcontext(&f.ctx, &s.main_ctx);
  fail("internal: a finished fiber was resumed");
}

void barrier(int site, metal::mem_flags) {
  Scheduler& s = sched();
  if (s.current < 0) fail("internal: threadgroup_barrier outside a fiber (the translator missed a barrier)");
  Fiber& f = s.fibers[s.current];
  f.state = kAtBarrier;
  f.site = site;
  start_switch(&f.fake_stack, s.main_bottom, s.main_size);
  swapcontext(&f.ctx, &s.main_ctx);
  finish_switch(f.fake_stack, &s.main_bottom, &s.main_size);
}

inline std::string str(const uint3& v) {
  return "(" + std::to_string(v.x) + ", " + std::to_string(v.y) + ", " + std::to_string(v.z) + ")";
}

// Runs one threadgroup's threads as fibers until all return; every barrier must be reached by all
// of them at the same call site (anything else is undefined behaviour on a GPU and an error here).
inline void run_group_fibers(const EntryDef& e, void* const* buffers, const std::vector<ThreadIds>& threads) {
  Scheduler& s = sched();
  s.entry = &e;
  s.buffers = buffers;
  if (s.fibers.size() < threads.size()) s.fibers.resize(threads.size());
  for (size_t i = 0; i < threads.size(); ++i) {
    Fiber& f = s.fibers[i];
    if (f.stack == nullptr) {
      void* mem = mmap(nullptr, kFiberStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) fail("cannot map a fiber stack");
      f.stack = static_cast<char*>(mem);
    }
    f.state = kReady;
    f.site = -1;
    f.id = threads[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kFiberStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, reinterpret_cast<void (*)()>(&fiber_main), 1, static_cast<int>(i));
  }
  const size_t n = threads.size();
  for (int round = 0;; ++round) {
    for (size_t i = 0; i < n; ++i) {
      Fiber& f = s.fibers[i];
      if (f.state != kReady) continue;
      s.current = static_cast<int>(i);
      start_switch(&s.main_fake_stack, f.stack, kFiberStack);
      swapcontext(&s.main_ctx, &f.ctx);
      finish_switch(s.main_fake_stack, nullptr, nullptr);
      s.current = -1;
    }
    size_t done = 0, waiting = 0;
    int site = -1;
    for (size_t i = 0; i < n; ++i) {
      const Fiber& f = s.fibers[i];
      if (f.state == kDone) {
        ++done;
      } else {
        ++waiting;
        if (site >= 0 && f.site != site) {
          fail("threadgroup " + str(f.id.threadgroup_position_in_grid) + ": threads wait at different "
               "threadgroup_barrier calls (#" + std::to_string(site) + " and #" + std::to_string(f.site) +
               ") — undefined behaviour on a GPU");
        }
        site = f.site;
      }
    }
    if (waiting == 0) return;
    if (done > 0) {
      fail("threadgroup " + str(s.fibers[0].id.threadgroup_position_in_grid) + ": " + std::to_string(waiting) +
           " of " + std::to_string(n) + " threads wait at threadgroup_barrier #" + std::to_string(site) + " after " +
           std::to_string(done) + " returned without reaching it (barrier in divergent control flow: "
           "undefined behaviour on a GPU)");
    }
    for (size_t i = 0; i < n; ++i) s.fibers[i].state = kReady;
  }
}

// ---------------------------------------------------------------------------- launch
struct Launch {
  std::string entry;
  int grid[3];
  int group[3];
  int order;  // 0 forward, 1 reverse, 2 shuffled
  uint64_t seed;
  struct Constant {
    int index;
    std::string type;
    uint32_t bits;
  };
  std::vector<Constant> constants;
  struct Bound {
    char* mem;        // the exactly sized allocation
    uint64_t bytes;
    uint64_t offset;  // the kernel's pointer: mem + offset
  };
  std::map<int, Bound> buffers;
};

struct Reader {
  FILE* f;
  const char* path;
  void bytes(void* dst, size_t n) {
    if (n && std::fread(dst, 1, n, f) != n) fail(std::string("truncated request file ") + path);
  }
  template <typename T>
  T get() {
    T v;
    bytes(&v, sizeof v);
    return v;
  }
  std::string str() {
    uint32_t n = get<uint32_t>();
    std::string s(n, '\0');
    bytes(&s[0], n);
    return s;
  }
};

inline Launch read_request(const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (!f) fail(std::string("cannot open request ") + path);
  Reader r{f, path};
  char magic[8];
  r.bytes(magic, 8);
  if (std::memcmp(magic, "METALEMU", 8) != 0 || r.get<uint32_t>() != 2) fail("bad request header");
  Launch L;
  L.entry = r.str();
  for (int i = 0; i < 3; ++i) L.grid[i] = r.get<int32_t>();
  for (int i = 0; i < 3; ++i) L.group[i] = r.get<int32_t>();
  L.order = static_cast<int>(r.get<uint32_t>());
  L.seed = r.get<uint64_t>();
  const uint32_t nc = r.get<uint32_t>();
  for (uint32_t i = 0; i < nc; ++i) {
    Launch::Constant c;
    c.index = r.get<int32_t>();
    c.type = r.str();
    c.bits = r.get<uint32_t>();
    L.constants.push_back(c);
  }
  const uint32_t nb = r.get<uint32_t>();
  for (uint32_t i = 0; i < nb; ++i) {
    const int index = r.get<int32_t>();
    const uint64_t n = r.get<uint64_t>();
    const uint64_t offset = r.get<uint64_t>();
    if (offset > n) fail("buffer(" + std::to_string(index) + ") bound at byte " + std::to_string(offset) + " of " +
                         std::to_string(n));
    char* mem = static_cast<char*>(std::malloc(n));  // exactly n bytes: ASan's redzone starts at mem + n
    if (mem == nullptr && n) fail("out of memory for buffer(" + std::to_string(index) + ")");
    r.bytes(mem, n);
    if (L.buffers.count(index)) fail("buffer(" + std::to_string(index) + ") bound twice");
    L.buffers[index] = {mem, n, offset};
  }
  std::fclose(f);
  return L;
}

inline void write_response(const char* path, const Launch& L) {
  FILE* f = std::fopen(path, "wb");
  if (!f) fail(std::string("cannot write response ") + path);
  std::fwrite("METALEMU", 1, 8, f);
  const uint32_t n = static_cast<uint32_t>(L.buffers.size());
  std::fwrite(&n, 4, 1, f);
  for (const auto& kv : L.buffers) {
    const int32_t index = kv.first;
    const uint64_t bytes = kv.second.bytes;
    std::fwrite(&index, 4, 1, f);
    std::fwrite(&bytes, 8, 1, f);
    if (bytes) std::fwrite(kv.second.mem, 1, bytes, f);
  }
  if (std::fclose(f) != 0) fail(std::string("cannot write response ") + path);
}

// Like MTLFunctionConstantValues at pipeline creation: every declared constant needs a value of
// its declared type; an index set twice in the source is an error.
inline void set_function_constants(const Launch& L) {
  const char* launcher_type[][2] = {{"int", "int32"}, {"float", "float32"}, {"bool", "bool"}, {"uint", "uint32"},
                                    {"short", "int16"}, {"ushort", "uint16"}, {"half", "float16"}};
  FunctionConstant* fcs = function_constants();
  const int n = n_function_constants();
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < i; ++j) {
      if (fcs[i].index == fcs[j].index) {
        fail("function constant index " + std::to_string(fcs[i].index) + " is declared twice (" + fcs[j].name +
             ", " + fcs[i].name + ")");
      }
    }
    const Launch::Constant* value = nullptr;
    for (const auto& c : L.constants) {
      if (c.index == fcs[i].index) value = &c;
    }
    if (value == nullptr) {
      fail("function constant " + std::to_string(fcs[i].index) + " (" + fcs[i].type + " " + fcs[i].name +
           ") has no value in this launch (Metal refuses to specialise the function)");
    }
    std::string expected;
    for (auto& m : launcher_type) {
      if (fcs[i].type == std::string(m[0])) expected = m[1];
    }
    if (value->type != expected) {
      fail("function constant " + std::to_string(fcs[i].index) + " (" + fcs[i].name + ") is declared " +
           fcs[i].type + " but the launch passes " + value->type + " (Metal refuses mismatched constant types)");
    }
    std::memcpy(fcs[i].ptr, &value->bits, static_cast<size_t>(fcs[i].size));  // little-endian low bytes
  }
}

inline uint3 u3(const int* v) { return uint3(uint(v[0]), uint(v[1]), uint(v[2])); }

inline void run(const EntryDef& e, const Launch& L) {
  void* buffers[64] = {};
  for (int i = 0; i < e.n_params; ++i) {
    const Param& p = e.params[i];
    if (p.kind != kBuffer) continue;
    if (p.index < 0 || p.index >= 64) fail(std::string("parameter ") + p.name + ": buffer index out of range");
    auto it = L.buffers.find(p.index);
    if (it == L.buffers.end()) {
      fail(std::string(e.name) + ": buffer(" + std::to_string(p.index) + ") (" + p.name + ") is not bound");
    }
    buffers[p.index] = it->second.mem + it->second.offset;
  }
  long threads = 1;
  for (int i = 0; i < 3; ++i) {
    if (L.grid[i] < 0 || L.group[i] < 1) fail("grid must be >= 0 and threadgroup >= 1 on every axis");
    threads *= L.group[i];
  }
  if (threads > 1024) fail("threadgroup of " + std::to_string(threads) + " threads exceeds Metal's 1024");
  if (e.max_threads > 0 && threads > e.max_threads) {
    fail("threadgroup of " + std::to_string(threads) + " threads exceeds the kernel's "
         "[[max_total_threads_per_threadgroup(" + std::to_string(e.max_threads) + ")]]");
  }
  int ngroups[3];
  for (int i = 0; i < 3; ++i) ngroups[i] = (L.grid[i] + L.group[i] - 1) / L.group[i];
  std::vector<uint3> groups;
  for (int z = 0; z < ngroups[2]; ++z)
    for (int y = 0; y < ngroups[1]; ++y)
      for (int x = 0; x < ngroups[0]; ++x) groups.push_back(uint3(uint(x), uint(y), uint(z)));
  std::mt19937_64 rng(L.seed);
  if (L.order == 1) std::reverse(groups.begin(), groups.end());
  if (L.order == 2) std::shuffle(groups.begin(), groups.end(), rng);

  std::vector<ThreadIds> threads_of_group;
  for (const uint3& tg : groups) {
    threads_of_group.clear();
    // dispatch_threads: a group at the grid's edge has only the threads inside the grid.
    uint3 size;
    for (int i = 0; i < 3; ++i) {
      const int start = int((&tg.x)[i]) * L.group[i];
      (&size.x)[i] = uint(std::min(L.group[i], L.grid[i] - start));
    }
    for (uint z = 0; z < size.z; ++z)
      for (uint y = 0; y < size.y; ++y)
        for (uint x = 0; x < size.x; ++x) {
          ThreadIds id;
          id.thread_position_in_threadgroup = uint3(x, y, z);
          id.threadgroup_position_in_grid = tg;
          id.thread_position_in_grid = uint3(tg.x * uint(L.group[0]) + x, tg.y * uint(L.group[1]) + y,
                                             tg.z * uint(L.group[2]) + z);
          id.threads_per_threadgroup = size;
          id.threads_per_grid = u3(L.grid);
          id.threadgroups_per_grid = u3(ngroups);
          id.thread_index_in_threadgroup = (z * size.y + y) * size.x + x;
          threads_of_group.push_back(id);
        }
    if (L.order == 1) std::reverse(threads_of_group.begin(), threads_of_group.end());
    if (L.order == 2) std::shuffle(threads_of_group.begin(), threads_of_group.end(), rng);
    poison_threadgroup_memory();
    if (e.uses_barriers) {
      run_group_fibers(e, buffers, threads_of_group);
    } else {
      for (const ThreadIds& id : threads_of_group) e.invoke(buffers, id, e.params);
    }
  }
}

inline int main(int argc, char** argv, const EntryDef* entries, int n_entries) {
  if (argc == 2 && std::string(argv[1]) == "--describe") {
    std::printf("{\"entries\": [");
    for (int i = 0; i < n_entries; ++i) {
      const EntryDef& e = entries[i];
      std::printf("%s{\"name\": \"%s\", \"uses_barriers\": %s, \"max_threads\": %d, \"params\": [%s]}", i ? ", " : "",
                  e.name, e.uses_barriers ? "true" : "false", e.max_threads, e.describe(e.params).c_str());
    }
    std::printf("], \"function_constants\": [");
    for (int i = 0; i < n_function_constants(); ++i) {
      const FunctionConstant& c = function_constants()[i];
      std::printf("%s{\"index\": %d, \"name\": \"%s\", \"type\": \"%s\"}", i ? ", " : "", c.index, c.name, c.type);
    }
    std::printf("]}\n");
    return 0;
  }
  if (argc != 3) fail("usage: runner --describe | runner REQUEST RESPONSE");
  Launch L = read_request(argv[1]);
  const EntryDef* entry = nullptr;
  std::string names;
  for (int i = 0; i < n_entries; ++i) {
    if (L.entry == entries[i].name) entry = &entries[i];
    names += std::string(i ? ", " : "") + entries[i].name;
  }
  if (entry == nullptr) fail("no entry " + L.entry + " in this source (it has: " + names + ")");
  set_function_constants(L);
  for (const auto& kv : L.buffers) {  // lets emulator.py name the buffer a sanitizer report points into
    std::fprintf(stderr, "metal_emu: buffer(%d) at %p size %llu\n", kv.first, static_cast<void*>(kv.second.mem),
                 static_cast<unsigned long long>(kv.second.bytes));
  }
  run(*entry, L);
  write_response(argv[2], L);
  return 0;
}

}  // namespace metal_emu
