/*
 * Runs TVM-generated Hexagon (HVX) kernels under qemu-hexagon user mode, with no libc and no TVM runtime.
 *
 * The android-hexagon build's HVX objects (the lib/ folder's hexagon_hvx .tar) are plain, non-system-lib TVM objects: each
 * kernel is a global `__tvm_ffi_<symbol>` with the packed-call ABI (TVMFFISafeCallType), and the code needs
 * only what this file supplies: the workspace allocator, reached through the function-pointer variables
 * `__TVMBackendAllocWorkspace` / `__TVMBackendFreeWorkspace` (weak in the object, which a TVM runtime fills
 * at load time; the strong definitions here win at link time), error reporting, and `__hexagon_sqrtf` from
 * Hexagon's compiler-rt. Everything else is raw Linux syscalls (qemu-hexagon implements the Linux syscall
 * ABI: number in r6, arguments in r0-r5, `trap0(#1)`).
 *
 * The kernel table (`harness_kernels`) is generated per link by pipeline/verify/qemu_hexagon.py from the
 * object's symbols. One request per run, read from stdin, all little-endian:
 *   u32 name length, name bytes (length 0: print the kernel names, one a line, and exit)
 *   u32 argument count, then per argument: u32 kind (0 tensor, 1 int64);
 *     tensor: u32 dtype code, u32 bits, u32 ndim, i64 shape[ndim], then its bytes;  int64: i64 value
 * Reply on stdout: the bytes of every tensor argument after the call, in order. Exit 0 on success, 1 when the
 * kernel returned an error, 2 on a malformed request; messages go to stderr.
 */
#include <stddef.h>
#include <stdint.h>

#include <tvm/ffi/c_api.h>

#define MAX_ARGS 64
#define MAX_DIMS 8
#define MAX_NAME 512

typedef struct {
  const char* name;
  TVMFFISafeCallType fn;
} HarnessKernel;

extern const HarnessKernel harness_kernels[];
extern const int harness_num_kernels;

/* ----------------------------------------------------------------------------------- raw syscalls */
enum { SYS_READ = 63, SYS_WRITE = 64, SYS_EXIT_GROUP = 94, SYS_MUNMAP = 215, SYS_MMAP = 222 };

static long sys6(long n, long a, long b, long c, long d, long e, long f) {
  register long r0 __asm__("r0") = a;
  register long r1 __asm__("r1") = b;
  register long r2 __asm__("r2") = c;
  register long r3 __asm__("r3") = d;
  register long r4 __asm__("r4") = e;
  register long r5 __asm__("r5") = f;
  register long r6 __asm__("r6") = n;
  __asm__ volatile("trap0(#1)" : "+r"(r0) : "r"(r1), "r"(r2), "r"(r3), "r"(r4), "r"(r5), "r"(r6) : "memory");
  return r0;
}

static __attribute__((noreturn)) void exit_now(int code) {
  sys6(SYS_EXIT_GROUP, code, 0, 0, 0, 0, 0);
  for (;;) {
  }
}

static size_t length(const char* s) {
  size_t n = 0;
  while (s[n]) n++;
  return n;
}

static int write_all(int fd, const void* data, size_t n) {
  const char* p = data;
  while (n) {
    long done = sys6(SYS_WRITE, fd, (long)p, (long)n, 0, 0, 0);
    if (done <= 0) return -1;
    p += done, n -= (size_t)done;
  }
  return 0;
}

static void say(const char* s) { write_all(2, s, length(s)); }

static int read_all(void* data, size_t n) {
  char* p = data;
  while (n) {
    long done = sys6(SYS_READ, 0, (long)p, (long)n, 0, 0, 0);
    if (done <= 0) return -1;
    p += done, n -= (size_t)done;
  }
  return 0;
}

/* Whole pages from the kernel: 4096-aligned, so every HVX vector load (128 bytes) of a tensor is aligned. */
static void* map_bytes(size_t n) {
  long p = sys6(SYS_MMAP, 0, (long)(n ? n : 1), 3 /* read|write */, 0x22 /* private|anonymous */, -1, 0);
  return (p < 0 && p > -4096) ? NULL : (void*)p;
}

/* Freestanding C still lets the compiler call these. */
void* memset(void* dst, int c, size_t n) {
  unsigned char* d = dst;
  while (n--) *d++ = (unsigned char)c;
  return dst;
}

void* memcpy(void* dst, const void* src, size_t n) {
  unsigned char* d = dst;
  const unsigned char* s = src;
  while (n--) *d++ = *s++;
  return dst;
}

/* ----------------------------------------------------------------------- what the kernels call */
typedef struct {
  size_t bytes;
} WorkspaceHead;

static void* alloc_workspace(int device_type, int device_id, uint64_t nbytes, int code_hint, int bits_hint) {
  (void)device_type, (void)device_id, (void)code_hint, (void)bits_hint;
  size_t total = (size_t)nbytes + 128; /* a 128-byte header keeps the workspace HVX-aligned */
  char* base = map_bytes(total);
  if (!base) return NULL;
  ((WorkspaceHead*)base)->bytes = total;
  return base + 128;
}

static int free_workspace(int device_type, int device_id, void* ptr) {
  (void)device_type, (void)device_id;
  char* base = (char*)ptr - 128;
  return (int)sys6(SYS_MUNMAP, (long)base, (long)((WorkspaceHead*)base)->bytes, 0, 0, 0, 0);
}

void* __TVMBackendAllocWorkspace = (void*)alloc_workspace;
void* __TVMBackendFreeWorkspace = (void*)free_workspace;

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t num_parts) {
  say("kernel error (");
  say(kind ? kind : "Error");
  say("): ");
  for (int32_t i = 0; i < num_parts; ++i) {
    if (parts[i]) say(parts[i]);
  }
  say("\n");
}

/* Square root without libm or division: a reciprocal-square-root estimate refined by Newton steps, then one
 * correction of x * rsqrt(x); within an ulp or two for normal inputs (the kernels take sqrt(mean(x^2) + eps)). */
float __hexagon_sqrtf(float x) {
  union {
    float f;
    uint32_t u;
  } v = {x};
  if (x != x || x == 0.0f || v.u == 0x7f800000u) return x; /* NaN, +-0, +inf */
  if (x < 0.0f) {
    v.u = 0x7fc00000u;
    return v.f;
  }
  v.u = 0x5f3759dfu - (v.u >> 1);
  float y = v.f;
  for (int i = 0; i < 4; ++i) y = y * (1.5f - 0.5f * x * y * y);
  float s = x * y;
  return s + 0.5f * y * (x - s * s);
}

/* ------------------------------------------------------------------------------------ one call */
typedef struct {
  DLTensor tensor;
  int64_t shape[MAX_DIMS];
} TensorArg;

static size_t tensor_bytes(const DLTensor* t) {
  size_t n = ((size_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
  for (int i = 0; i < t->ndim; ++i) n *= (size_t)t->shape[i];
  return n;
}

static int equal(const char* a, const char* b) {
  while (*a && *a == *b) a++, b++;
  return *a == *b;
}

static __attribute__((noreturn)) void fail(const char* what, int code) {
  say(what);
  say("\n");
  exit_now(code);
}

static int run(void) {
  uint32_t name_len = 0;
  static char name[MAX_NAME + 1];
  if (read_all(&name_len, 4) || name_len > MAX_NAME || read_all(name, name_len)) fail("bad request: name", 2);
  name[name_len] = 0;
  if (name_len == 0) {
    for (int i = 0; i < harness_num_kernels; ++i) {
      write_all(1, harness_kernels[i].name, length(harness_kernels[i].name));
      write_all(1, "\n", 1);
    }
    return 0;
  }
  TVMFFISafeCallType fn = NULL;
  for (int i = 0; i < harness_num_kernels && !fn; ++i) {
    if (equal(harness_kernels[i].name, name)) fn = harness_kernels[i].fn;
  }
  if (!fn) fail("no such kernel in the linked objects", 2);

  static TensorArg tensors[MAX_ARGS];
  static TVMFFIAny args[MAX_ARGS];
  uint32_t num_args = 0;
  int num_tensors = 0;
  if (read_all(&num_args, 4) || num_args > MAX_ARGS) fail("bad request: argument count", 2);
  for (uint32_t a = 0; a < num_args; ++a) {
    uint32_t kind;
    memset(&args[a], 0, sizeof(TVMFFIAny));
    if (read_all(&kind, 4)) fail("bad request: argument kind", 2);
    if (kind == 1) {
      args[a].type_index = kTVMFFIInt;
      if (read_all(&args[a].v_int64, 8)) fail("bad request: int argument", 2);
      continue;
    }
    uint32_t head[3];
    TensorArg* arg = &tensors[num_tensors++];
    DLTensor* t = &arg->tensor;
    if (kind != 0 || read_all(head, 12) || head[2] > MAX_DIMS) fail("bad request: tensor header", 2);
    memset(t, 0, sizeof(*t));
    t->device.device_type = kDLCPU;
    t->dtype.code = (uint8_t)head[0];
    t->dtype.bits = (uint8_t)head[1];
    t->dtype.lanes = 1;
    t->ndim = (int32_t)head[2];
    t->shape = arg->shape;
    if (read_all(arg->shape, 8 * head[2])) fail("bad request: tensor shape", 2);
    size_t nbytes = tensor_bytes(t);
    t->data = map_bytes(nbytes);
    if (!t->data || read_all(t->data, nbytes)) fail("bad request: tensor data", 2);
    args[a].type_index = kTVMFFIDLTensorPtr;
    args[a].v_ptr = t;
  }
  TVMFFIAny result;
  memset(&result, 0, sizeof(result));
  result.type_index = kTVMFFINone;
  if (fn(NULL, args, (int32_t)num_args, &result) != 0) return 1;
  for (int i = 0; i < num_tensors; ++i) {
    if (write_all(1, tensors[i].tensor.data, tensor_bytes(&tensors[i].tensor))) fail("cannot write the reply", 2);
  }
  return 0;
}

__attribute__((noreturn)) void _start(void) { exit_now(run()); }
