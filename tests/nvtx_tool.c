/* A minimal NVTX tool for the tests: loaded by NVTX itself through NVTX_INJECTION64_PATH, as
 * Nsight Systems' is, it counts RangePushA/RangePop and keeps the names pushed, which the test
 * reads back through ctypes (tool_pushes, tool_pops, tool_max_depth, tool_names). Only the NVTX
 * injection ABI is declared here (nvtxTypes.h: the callbacks export table, core module ids). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*NvtxFunctionPointer)(void);
typedef NvtxFunctionPointer **NvtxFunctionTable;
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, NvtxFunctionTable *out_table, unsigned int *out_size);
} NvtxExportTableCallbacks;
typedef const void *(*NvtxGetExportTableFunc_t)(uint32_t id);

#define NVTX_ETID_CALLBACKS 1
#define NVTX_CB_MODULE_CORE 1
#define NVTX_CBID_CORE_RangePushA 9
#define NVTX_CBID_CORE_RangePop 11

static long pushes, pops, depth, max_depth;
static char names[1 << 16];
static size_t used;

static int push_a(const char *message) {
    pushes++;
    if (++depth > max_depth) max_depth = depth;
    size_t n = message ? strlen(message) : 0;
    if (used + n + 2 < sizeof(names)) {
        memcpy(names + used, message, n);
        used += n;
        names[used++] = '\n';
    }
    return (int)depth - 1;
}

static int pop(void) {
    pops++;
    return (int)--depth;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
    const NvtxExportTableCallbacks *cb = (const NvtxExportTableCallbacks *)get(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable table = 0;
    unsigned int size = 0;
    if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) || !table) return 0;
    if (size <= NVTX_CBID_CORE_RangePop) return 0;
    *table[NVTX_CBID_CORE_RangePushA] = (NvtxFunctionPointer)push_a;
    *table[NVTX_CBID_CORE_RangePop] = (NvtxFunctionPointer)pop;
    return 1;
}

long tool_pushes(void) { return pushes; }
long tool_pops(void) { return pops; }
long tool_max_depth(void) { return max_depth; }
const char *tool_names(void) {
    names[used] = 0;
    return names;
}
