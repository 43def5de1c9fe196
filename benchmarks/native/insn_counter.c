/*
 * QEMU 7.2 TCG plugin (plugin API v1) for qemu-aarch64 and qemu-hexagon user mode: what a program executes, as
 * counts.
 *
 * Counts, for the whole program and for code inside a set of address ranges [lo, hi) (e.g. a kernel's symbols
 * from `nm -S`): guest instructions, instructions that name a SIMD vector register (v<n>., q<n> or SVE z<n> in
 * their disassembly), load / store accesses and their bytes. Under qemu-hexagon an "instruction" is a packet
 * (qemu translates a Hexagon packet as one guest instruction) and a vector one names an HVX register (V<n> or
 * Q<n> in qemu's packet disassembly). Instruction counts are added per translation block
 * when it executes (a TB runs to its end in user mode), memory per access. Every vCPU (each guest thread under
 * qemu-user) adds into its own slot with relaxed atomics, so a program's threads never lose counts.
 *
 * Debian's qemu-user ships no qemu-plugin.h: the few API declarations used are written out below (ABI of
 * QEMU 7.2, plugin API version 1).
 *
 *   qemu-aarch64 -plugin ./insn_counter.so,out=FILE[,range=0xLO-0xHI]... ./prog args
 *
 * At exit FILE gets one JSON object: {"total": {...}, "range": {...}, "per_vcpu_insns": [...]} (per vCPU index;
 * qemu-user gives a new thread the index of one that has exited, so indices are not threads).
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the subset of qemu-plugin.h (QEMU 7.2) this plugin uses ---- */
typedef uint64_t qemu_plugin_id_t;
typedef uint32_t qemu_plugin_meminfo_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_CB_R_REGS, QEMU_PLUGIN_CB_RW_REGS };
enum qemu_plugin_mem_rw { QEMU_PLUGIN_MEM_R = 1, QEMU_PLUGIN_MEM_W, QEMU_PLUGIN_MEM_RW };
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb* tb);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void* userdata);
typedef void (*qemu_plugin_vcpu_mem_cb_t)(unsigned int vcpu_index, qemu_plugin_meminfo_t info, uint64_t vaddr,
                                          void* userdata);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void* userdata);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb* tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void* userdata);
void qemu_plugin_register_vcpu_mem_cb(struct qemu_plugin_insn* insn, qemu_plugin_vcpu_mem_cb_t cb,
                                      enum qemu_plugin_cb_flags flags, enum qemu_plugin_mem_rw rw, void* userdata);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void* userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb* tb);
struct qemu_plugin_insn* qemu_plugin_tb_get_insn(const struct qemu_plugin_tb* tb, size_t idx);
uint64_t qemu_plugin_insn_vaddr(const struct qemu_plugin_insn* insn);
const void* qemu_plugin_insn_data(const struct qemu_plugin_insn* insn);
size_t qemu_plugin_insn_size(const struct qemu_plugin_insn* insn);
char* qemu_plugin_insn_disas(const struct qemu_plugin_insn* insn);
unsigned int qemu_plugin_mem_size_shift(qemu_plugin_meminfo_t info);
bool qemu_plugin_mem_is_store(qemu_plugin_meminfo_t info);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;
/* ---- end of the API subset ---- */

#define MAX_VCPUS 256 /* more guest threads share slots (atomics keep the sums right) */
#define MAX_RANGES 256

enum { INSNS, VEC, LOADS, LOAD_BYTES, STORES, STORE_BYTES, NUM_COUNTS };
static const char* const COUNT_NAMES[NUM_COUNTS] = {"insns", "vector_insns", "loads", "load_bytes", "stores",
                                                    "store_bytes"};

typedef struct {
  uint64_t total[NUM_COUNTS];
  uint64_t range[NUM_COUNTS];
  char pad[64]; /* keeps neighbouring vCPUs' slots off one cache line */
} Slot;

static Slot slots[MAX_VCPUS];
static uint64_t range_lo[MAX_RANGES], range_hi[MAX_RANGES];
static int num_ranges = 0;
static unsigned max_vcpu_seen = 0;
static char out_path[4096] = "";

/* What one translation block adds each time it runs (decided once, when it is translated). */
typedef struct {
  uint64_t insns, vec, range_insns, range_vec;
} BlockCounts;

static bool in_ranges(uint64_t pc) {
  for (int i = 0; i < num_ranges; ++i) {
    if (pc >= range_lo[i] && pc < range_hi[i]) return true;
  }
  return false;
}

static bool is_reg_char(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '_'; }

/* Does the operand text name v<n> (followed by '.', e.g. v3.4s or v3.s[1]), q<n> or z<n> (aarch64, lower case),
 * or an HVX vector / predicate register V<n> / Q<n> (Hexagon packets, upper case: V0.w, V1:0, Q2)? */
static bool is_upper(char c) { return c >= 'A' && c <= 'Z'; }

static bool names_hvx_register(const char* text, const char* p) {
  if ((*p != 'V' && *p != 'Q') || (p > text && (is_reg_char(p[-1]) || is_upper(p[-1])))) return false;
  const char* d = p + 1;
  if (*d < '0' || *d > '9') return false;
  while (*d >= '0' && *d <= '9') ++d;
  return !is_reg_char(*d) && !is_upper(*d);
}

static bool names_vector_register(const char* disas) {
  for (const char* p = disas; *p; ++p) {
    if (names_hvx_register(disas, p)) return true;
  }
  const char* ops = strchr(disas, ' ');
  if (!ops) return false;
  for (const char* p = ops; *p; ++p) {
    if ((*p != 'v' && *p != 'q' && *p != 'z') || is_reg_char(p[-1])) continue;
    const char* d = p + 1;
    if (*d < '0' || *d > '9') continue;
    while (*d >= '0' && *d <= '9') ++d;
    if (*p == 'v' ? *d == '.' : !is_reg_char(*d)) return true;
  }
  return false;
}

/* Without a disassembly: the encoding's SIMD&FP groups (data processing op0 = x111, loads/stores with V set). */
static bool encoding_is_simd(const struct qemu_plugin_insn* insn) {
  if (qemu_plugin_insn_size(insn) != 4) return false;
  uint32_t word;
  memcpy(&word, qemu_plugin_insn_data(insn), 4);
  uint32_t op0 = (word >> 25) & 0xf;
  bool simd_dp = (op0 & 0x7) == 0x7;
  bool simd_ldst = (op0 & 0x5) == 0x4 && ((word >> 26) & 1);
  return simd_dp || simd_ldst;
}

/* qemu 7.2's disassembler (capstone) knows no armv8.2 dot products: it prints `sdot` / `udot` as `.byte 0x..`.
 * Such an instruction is classified by its encoding instead, else every dot product would count as scalar. */
static bool decoded(const char* disas) {
  return disas && strncmp(disas, ".byte", 5) != 0 && strncmp(disas, ".inst", 5) != 0 && strncmp(disas, ".word", 5) != 0;
}

static inline void add(uint64_t* counter, uint64_t n) { __atomic_fetch_add(counter, n, __ATOMIC_RELAXED); }

static void note_vcpu(unsigned vcpu) {
  unsigned seen = __atomic_load_n(&max_vcpu_seen, __ATOMIC_RELAXED);
  while (vcpu + 1 > seen &&
         !__atomic_compare_exchange_n(&max_vcpu_seen, &seen, vcpu + 1, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

static void block_executed(unsigned vcpu, void* userdata) {
  const BlockCounts* b = userdata;
  Slot* s = &slots[vcpu % MAX_VCPUS];
  note_vcpu(vcpu);
  add(&s->total[INSNS], b->insns);
  add(&s->total[VEC], b->vec);
  if (b->range_insns) {
    add(&s->range[INSNS], b->range_insns);
    add(&s->range[VEC], b->range_vec);
  }
}

static void memory_accessed(unsigned vcpu, qemu_plugin_meminfo_t info, uint64_t vaddr, void* userdata) {
  (void)vaddr;
  Slot* s = &slots[vcpu % MAX_VCPUS];
  uint64_t bytes = 1ull << qemu_plugin_mem_size_shift(info);
  int kind = qemu_plugin_mem_is_store(info) ? STORES : LOADS;
  add(&s->total[kind], 1);
  add(&s->total[kind + 1], bytes);
  if (userdata) { /* non-NULL: the instruction lies inside a range */
    add(&s->range[kind], 1);
    add(&s->range[kind + 1], bytes);
  }
}

static void block_translated(qemu_plugin_id_t id, struct qemu_plugin_tb* tb) {
  (void)id;
  BlockCounts* b = calloc(1, sizeof(*b)); /* lives as long as the block may run: never freed */
  size_t n = qemu_plugin_tb_n_insns(tb);
  for (size_t i = 0; i < n; ++i) {
    struct qemu_plugin_insn* insn = qemu_plugin_tb_get_insn(tb, i);
    char* disas = qemu_plugin_insn_disas(insn);
    bool vec = decoded(disas) ? names_vector_register(disas) : encoding_is_simd(insn);
    free(disas);
    bool in = in_ranges(qemu_plugin_insn_vaddr(insn));
    b->insns += 1;
    b->vec += vec;
    b->range_insns += in;
    b->range_vec += in && vec;
    qemu_plugin_register_vcpu_mem_cb(insn, memory_accessed, QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_MEM_RW,
                                     in ? (void*)1 : NULL);
  }
  qemu_plugin_register_vcpu_tb_exec_cb(tb, block_executed, QEMU_PLUGIN_CB_NO_REGS, b);
}

static void write_counts(FILE* f, const char* name, int which) {
  fprintf(f, "\"%s\": {", name);
  for (int k = 0; k < NUM_COUNTS; ++k) {
    uint64_t sum = 0;
    for (int v = 0; v < MAX_VCPUS; ++v) sum += which ? slots[v].range[k] : slots[v].total[k];
    fprintf(f, "%s\"%s\": %" PRIu64, k ? ", " : "", COUNT_NAMES[k], sum);
  }
  fprintf(f, "}");
}

static void at_exit(qemu_plugin_id_t id, void* userdata) {
  (void)id, (void)userdata;
  FILE* f = out_path[0] ? fopen(out_path, "w") : stderr;
  if (!f) {
    fprintf(stderr, "insn_counter: cannot write %s\n", out_path);
    return;
  }
  fprintf(f, "{");
  write_counts(f, "total", 0);
  fprintf(f, ", ");
  write_counts(f, "range", 1);
  fprintf(f, ", \"num_ranges\": %d, \"per_vcpu_insns\": [", num_ranges);
  unsigned n = max_vcpu_seen < MAX_VCPUS ? max_vcpu_seen : MAX_VCPUS;
  for (unsigned v = 0; v < n; ++v) fprintf(f, "%s%" PRIu64, v ? ", " : "", slots[v].total[INSNS]);
  fprintf(f, "]}\n");
  if (f != stderr) fclose(f);
}

static int parse_arg(const char* arg) {
  if (strncmp(arg, "out=", 4) == 0) {
    snprintf(out_path, sizeof(out_path), "%s", arg + 4);
    return 0;
  }
  if (strncmp(arg, "range=", 6) == 0 && num_ranges < MAX_RANGES) {
    char* end;
    uint64_t lo = strtoull(arg + 6, &end, 0);
    if (*end != '-') return -1;
    uint64_t hi = strtoull(end + 1, &end, 0);
    if (*end || hi <= lo) return -1;
    range_lo[num_ranges] = lo;
    range_hi[num_ranges] = hi;
    num_ranges++;
    return 0;
  }
  return -1;
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t* info,
                                                               int argc, char** argv) {
  (void)info;
  for (int i = 0; i < argc; ++i) {
    if (parse_arg(argv[i]) != 0) {
      fprintf(stderr, "insn_counter: bad argument %s (out=FILE, range=0xLO-0xHI, at most %d ranges)\n", argv[i],
              MAX_RANGES);
      return -1;
    }
  }
  qemu_plugin_register_vcpu_tb_trans_cb(id, block_translated);
  qemu_plugin_register_atexit_cb(id, at_exit, NULL);
  return 0;
}
