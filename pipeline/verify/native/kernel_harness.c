/*
 * Runs kernels of a TVM system-lib object (e.g. lib0.o of an android-cpu .tar) without the TVM runtime.
 *
 * The object's start-up code registers every kernel through TVMFFIEnvModRegisterSystemLibSymbol; this file
 * supplies that and the few other runtime symbols the kernels reference (workspace allocation, error
 * reporting, parallel launch), keeps the registered (name, function) table, and calls a kernel through its packed-call ABI
 * (TVMFFISafeCallType) with DLTensor arguments read from files. Built statically for aarch64 and run under
 * qemu-aarch64 by pipeline/verify/qemu_aarch64.py.
 *
 *   kernel_harness list                  print the registered symbol names
 *   kernel_harness call NAME ARGFILE     call NAME; ARGFILE has one argument per line:
 *       T <dtype code> <bits> <ndim> <dim>... <input file | -> <output file | ->   (a DLTensor on the CPU)
 *       I <int64 value>                                                              (an integer)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tvm/ffi/c_api.h>

#define MAX_SYMBOLS 4096
#define MAX_ARGS 64
#define MAX_DIMS 8

static struct {
  const char* name;
  void* symbol;
} registry[MAX_SYMBOLS];
static int num_registered = 0;

int TVMFFIEnvModRegisterSystemLibSymbol(const char* name, void* symbol) {
  if (num_registered == MAX_SYMBOLS) return -1;
  registry[num_registered].name = name;
  registry[num_registered].symbol = symbol;
  num_registered++;
  return 0;
}

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t num_parts) {
  fprintf(stderr, "kernel error (%s): ", kind ? kind : "Error");
  for (int32_t i = 0; i < num_parts; ++i) {
    if (parts[i]) fputs(parts[i], stderr);
  }
  fputc('\n', stderr);
}

void* TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes, int dtype_code_hint,
                               int dtype_bits_hint) {
  (void)device_type, (void)device_id, (void)dtype_code_hint, (void)dtype_bits_hint;
  void* ptr = NULL;
  return posix_memalign(&ptr, 64, nbytes ? nbytes : 1) == 0 ? ptr : NULL;
}

int TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr) {
  (void)device_type, (void)device_id;
  free(ptr);
  return 0;
}

/* Parallel loops (e.g. pipeline/kernels/cpu/attention.py's kernels) call back through TVM's thread-pool ABI. The
 * harness runs the tasks one after another on this thread: with HARNESS_TASKS tasks (not one) so the
 * kernels' work split across tasks is exercised as it is on the phone; the environment variable of that name
 * sets another count (e.g. 1 and 4, to check that a kernel's result does not depend on the thread count). */
typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);
#ifndef HARNESS_TASKS /* -DHARNESS_TASKS=N: benchmarks/phone_cpu_ours.py counts a kernel's work split N ways */
#define HARNESS_TASKS 3
#endif

int TVMBackendParallelLaunch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  const char* tasks = getenv("HARNESS_TASKS");
  int pool = tasks && atoi(tasks) > 0 ? atoi(tasks) : HARNESS_TASKS;
  TVMParallelGroupEnv env = {NULL, num_task > 0 ? num_task : pool};
  for (int task = 0; task < env.num_task; ++task) {
    int rc = flambda(task, &env, cdata);
    if (rc != 0) return rc;
  }
  return 0;
}

int TVMBackendParallelBarrier(int task_id, TVMParallelGroupEnv* penv) {
  (void)task_id, (void)penv;
  return 0; /* tasks run in order; a kernel that needs a real barrier would be wrong here, none does */
}

static void* lookup(const char* name) {
  for (int i = 0; i < num_registered; ++i) {
    if (strcmp(registry[i].name, name) == 0) return registry[i].symbol;
  }
  return NULL;
}

typedef struct {
  DLTensor tensor;
  int64_t shape[MAX_DIMS];
  char out_path[4096];
} TensorArg;

static size_t tensor_bytes(const DLTensor* t) {
  size_t n = (t->dtype.bits * t->dtype.lanes + 7) / 8;
  for (int i = 0; i < t->ndim; ++i) n *= (size_t)t->shape[i];
  return n;
}

static int read_tensor(FILE* f, TensorArg* arg) {
  int code, bits, ndim;
  char in_path[4096];
  if (fscanf(f, "%d %d %d", &code, &bits, &ndim) != 3 || ndim < 0 || ndim > MAX_DIMS) return -1;
  for (int i = 0; i < ndim; ++i) {
    long long d;
    if (fscanf(f, "%lld", &d) != 1) return -1;
    arg->shape[i] = d;
  }
  if (fscanf(f, "%4095s %4095s", in_path, arg->out_path) != 2) return -1;
  DLTensor* t = &arg->tensor;
  memset(t, 0, sizeof(*t));
  t->device.device_type = kDLCPU;
  t->ndim = ndim;
  t->dtype.code = (uint8_t)code;
  t->dtype.bits = (uint8_t)bits;
  t->dtype.lanes = 1;
  t->shape = arg->shape;
  size_t nbytes = tensor_bytes(t);
  if (posix_memalign(&t->data, 64, nbytes ? nbytes : 1) != 0) return -1;
  memset(t->data, 0, nbytes);
  if (strcmp(in_path, "-") != 0) {
    FILE* in = fopen(in_path, "rb");
    if (!in || fread(t->data, 1, nbytes, in) != nbytes) {
      fprintf(stderr, "cannot read %zu bytes from %s\n", nbytes, in_path);
      return -1;
    }
    fclose(in);
  }
  return 0;
}

static int write_tensor(const TensorArg* arg) {
  if (strcmp(arg->out_path, "-") == 0) return 0;
  FILE* out = fopen(arg->out_path, "wb");
  size_t nbytes = tensor_bytes(&arg->tensor);
  if (!out || fwrite(arg->tensor.data, 1, nbytes, out) != nbytes) {
    fprintf(stderr, "cannot write %s\n", arg->out_path);
    return -1;
  }
  return fclose(out);
}

static int call(const char* name, const char* arg_file) {
  TVMFFISafeCallType fn = (TVMFFISafeCallType)lookup(name);
  if (!fn) {
    fprintf(stderr, "no kernel named %s in the library (try: list)\n", name);
    return 2;
  }
  FILE* f = fopen(arg_file, "r");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", arg_file);
    return 2;
  }
  static TensorArg tensors[MAX_ARGS];
  TVMFFIAny args[MAX_ARGS];
  int num_args = 0, num_tensors = 0;
  char kind[4];
  while (num_args < MAX_ARGS && fscanf(f, "%3s", kind) == 1) {
    memset(&args[num_args], 0, sizeof(TVMFFIAny));
    if (kind[0] == 'T') {
      if (read_tensor(f, &tensors[num_tensors]) != 0) return 2;
      args[num_args].type_index = kTVMFFIDLTensorPtr;
      args[num_args].v_ptr = &tensors[num_tensors].tensor;
      num_tensors++;
    } else if (kind[0] == 'I') {
      long long v;
      if (fscanf(f, "%lld", &v) != 1) return 2;
      args[num_args].type_index = kTVMFFIInt;
      args[num_args].v_int64 = v;
    } else if (kind[0] == 'F') {
      double v;
      if (fscanf(f, "%lf", &v) != 1) return 2;
      args[num_args].type_index = kTVMFFIFloat;
      args[num_args].v_float64 = v;
    } else {
      fprintf(stderr, "bad argument kind %s in %s\n", kind, arg_file);
      return 2;
    }
    num_args++;
  }
  fclose(f);
  TVMFFIAny result;
  memset(&result, 0, sizeof(result));
  result.type_index = kTVMFFINone;
  if (fn(NULL, args, num_args, &result) != 0) return 1;
  for (int i = 0; i < num_tensors; ++i) {
    if (write_tensor(&tensors[i]) != 0) return 2;
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && strcmp(argv[1], "list") == 0) {
    for (int i = 0; i < num_registered; ++i) printf("%s\n", registry[i].name);
    return 0;
  }
  if (argc == 4 && strcmp(argv[1], "call") == 0) return call(argv[2], argv[3]);
  fprintf(stderr, "usage: %s list | call NAME ARGFILE\n", argv[0]);
  return 2;
}
