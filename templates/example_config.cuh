// ---- example config of llama3.2-1b_decode_b1_s4096_bf16 (for opening a header alone; generated: every number comes from the planner; the manifest records the same) ----
#define MEGAKERNEL_CONFIG 1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#pragma nv_diag_suppress 177  // one config serves every stage: not every stage reads every constant
constexpr int HIDDEN = 2048;
constexpr int HEADS = 32;
constexpr int KV_HEADS = 8;
constexpr int HEAD_DIM = 64;
constexpr int INTER = 8192;
constexpr int TP = 1;
constexpr int BATCH = 1;
constexpr int SEQ_LEN = 4096;
constexpr int WINDOW = 0;
constexpr int THREADS = 512;
constexpr int GROUP = 4;
constexpr int Q_DIM = 2048;
constexpr int KV_DIM = 512;
constexpr int QKV_DIM = 3072;
constexpr int XS_LD = 2056;
constexpr int ATT_C = 256;
constexpr int ATT_WARPS = 8;
constexpr int ATT_STAGES = 2;
constexpr int ATT_NSPLIT = 16;
constexpr int ATT_COMBINE = 1;
constexpr int ATT_DYN = 0;
constexpr int ATT_PIECE_TILES = 0;
constexpr int ATT_TMA = 0;
constexpr int ATT_QSMEM = 0;
constexpr int X_FRAG = 1;
constexpr int HB_COPY = 1;
constexpr int GEMV_PF = 1;
constexpr int NORM_FOLD = 3;
constexpr int RED_DB = 1;
constexpr int NORM_CLUSTER = 1;
constexpr int QKV_FLOW = 2;
constexpr int DOWN_FLOW = 1;
constexpr int ACT_CHUNKS = 4;
constexpr int ACT_STRIDE = 32;
constexpr int NORM_GLOBAL = 0;
constexpr int NORM_LOCAL = 1;
constexpr int NORM2_LOCAL = 1;
constexpr int ATT_LL = 1;
constexpr int H_LL = 1;
constexpr int TIMELINE = 0;
constexpr int COOP = 0;
constexpr int DOWN_SMEM = 0;
constexpr int DW_KT = 0;
constexpr int GU_SKIP = 0;
constexpr int GEMM_PROJ = 0;
constexpr int QKV_GEMM = 0;
constexpr int O_GEMM = 0;
constexpr int DOWN_GEMM = 0;
constexpr int GEMM_WGMMA = 0;
constexpr int GEMM_WM = 16;
constexpr int GEMM_TM = 1;
constexpr int GEMM_TN = 2;
constexpr int GEMM_BK = 64;
constexpr int GEMM_STAGES = 5;
constexpr int GEMM_XROWS = 16;
constexpr int GEMM_TOKEN_TILE = 64;
constexpr int GEMM_GM = 3;
constexpr int QKV_GSPLIT = 1;
constexpr int QKV_GFULL = 0;
constexpr int O_GSPLIT = 1;
constexpr int O_GFULL = 0;
constexpr int GU_GSPLIT = 1;
constexpr int GU_GFULL = 0;
constexpr int DOWN_GSPLIT = 1;
constexpr int DOWN_GFULL = 0;
constexpr int SMEM_XS = 0;
constexpr int SMEM_RED = 4112;
constexpr int SMEM_QS = 0;
constexpr int SMEM_QP = 1552;
constexpr int SMEM_PT = 1552;
constexpr int SMEM_WST = 7696;
constexpr int SMEM_FLAG = 81424;
constexpr int SMEM_SCHED = 81440;
constexpr int SMEM_MBAR = 81440;
constexpr int SMEM_GS = 6160;
constexpr int SMEM_SQ = 0;
constexpr int SMEM_RS = 10256;
constexpr int SMEM_DW = 0;
constexpr int SMEM_DWBAR = 0;
constexpr int QKV_NWG = 16;
constexpr int QKV_U = 8;
constexpr int QKV_KSPLIT = 1;
constexpr int QKV_TM = 1;
constexpr int QKV_PRE = 1;
constexpr int O_NWG = 16;
constexpr int O_U = 8;
constexpr int O_KSPLIT = 1;
constexpr int O_TM = 1;
constexpr int O_PRE = 1;
constexpr int GU_NWG = 16;
constexpr int GU_U = 8;
constexpr int GU_KSPLIT = 1;
constexpr int GU_TM = 1;
constexpr int GU_PRE = 0;
constexpr int DOWN_NWG = 16;
constexpr int DOWN_U = 8;
constexpr int DOWN_KSPLIT = 1;
constexpr int DOWN_TM = 1;
constexpr int DOWN_PRE = 0;
constexpr int QKV_QFIRST = 1;
constexpr int ATT_KVLAST = 1;
constexpr int ATT_ROT = 1;
constexpr int H_STATS = 0;
constexpr int QKV_BS = 1;
constexpr int O_BS = 1;
constexpr int GU_BS = 1;
constexpr int DOWN_BS = 1;
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
