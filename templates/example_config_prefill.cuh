// ---- example config of llama3.2-1b_prefill_b1_s64_bf16 (for opening a header alone; generated: every number comes from the planner; the manifest records the same) ----
#define MEGAKERNEL_CONFIG 1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#pragma nv_diag_suppress 177  // one config serves every stage: not every stage reads every constant
constexpr int HIDDEN = 2048;
constexpr int HEADS = 32;
constexpr int KV_HEADS = 8;
constexpr int HEAD_DIM = 64;
constexpr int INTER = 8192;
constexpr int BATCH = 1;
constexpr int CHUNK = 64;
constexpr int ROWS = 64;
constexpr int WINDOW = 0;
constexpr int THREADS = 384;
constexpr int GROUP = 4;
constexpr int Q_DIM = 2048;
constexpr int KV_DIM = 512;
constexpr int QKV_DIM = 3072;
constexpr int ATT_NSPLIT = 0;
constexpr int ATT_INLINE = 0;
constexpr int GEMM_WGMMA = 1;
constexpr int GEMM_WM = 12;
constexpr int GEMM_GM = 7;
constexpr int GEMM_TM = 1;
constexpr int GEMM_TN = 8;
constexpr int GEMM_BK = 64;
constexpr int GEMM_STAGES = 5;
constexpr int GEMM_XROWS = 64;
constexpr int QKV_KSPLIT = 8;
constexpr int QKV_FULL = 0;
constexpr int O_KSPLIT = 8;
constexpr int O_FULL = 0;
constexpr int GU_KSPLIT = 1;
constexpr int GU_FULL = 0;
constexpr int DOWN_KSPLIT = 12;
constexpr int DOWN_FULL = 0;
constexpr int TMAP_BYTES = 128;  // a tensor map's size in w_tmaps
// TIMELINE: a block's stamps, attention's phases from TL_ATT (generator.interface)
constexpr int TL_SLOTS = 24, TL_ATT = 16;
constexpr int TMAP_QKV = 0;  // w_tmaps' w_qkv
constexpr int TMAP_O = 1;  // w_tmaps' w_o
constexpr int TMAP_GU = 2;  // w_tmaps' w_gu
constexpr int TMAP_DOWN = 3;  // w_tmaps' w_down
constexpr float NORM_EPS = 1e-05f;
constexpr float SCORE_SCALE = 0.18033688011112042f;  // log2(e) / sqrt(head_dim): softmax runs on exp2
constexpr float ROPE_ATTN = 1.0f;  // RoPE's cos / sin factor (yarn's attention factor, else 1): q and k x it
typedef __nv_bfloat16 T;
typedef __nv_bfloat162 T2;
constexpr float T_MAX = 3.3895313892515355e+38f;  // largest finite T
#define DTYPE_BF16 1
#define MMA_AB "bf16"
#define NORM_LAYERNORM 0
#define ACT_GELU 0
#define QKV_BIAS 0
#define QK_NORM 0
