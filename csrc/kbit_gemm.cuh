// kbit_gemm.cuh: fused k-bit dequantize + GEMM (device code only).
//
// ============================================================================================
// DESIGN
// ============================================================================================
// 1. What is computed
//    C[M, N] = A[M, K_dim] @ W[N, K_dim]^T (+ bias[N]); A, C, bias fp16 or bf16 (one dtype),
//    fp32 accumulation. W is k-bit (K_BITS = 2..5): 32-element blocks along K_dim, one absmax per
//    block (E4M4 uint8 or fp16), codebook float32 of L <= 2^K_BITS entries. No buffer may alias C.
//
// 2. Tile hierarchy ("swap AB": the WEIGHT is the MMA A-operand, the activations the B-operand)
//    mma.sync.m16n8k16: m16 = 16 rows n of W, n8 = 8 tokens m of A, k16 = 16 of K_dim.
//    D[n16 x m8] = Wdeq[n16 x k16] * A^T[k16 x m8]: at M = 1 seven of the 8 token columns are zero,
//    but the tensor core makes the FMAs free; the integer/LDS work per weight is what bounds M = 1.
//      unit  = 16 rows n x 128 k (a "k-step" of 4 quantization blocks): the repack granule
//      warp  = MT units along n (MT x 16 rows) x MB n8 token tiles, streaming its own k range
//      CTA   = WARPS_N x WARPS_K warps: along n different rows (same A), along k contiguous chunks of
//              the CTA's k-steps, reduced in shared memory at the end
//      grid  = (n_ctas, k_splits, m_tiles); k_splits > 1 reduces through the workspace (section 5)
//    Configs (kbit_gemm.cu, three tables):
//      per-warp ring (kbit_gemm_kernel): 0 = MB 1, 1 = MB 2; MT = 2, 8 warps = 2 (n) x 4 (k), 64-row
//        CTAs: small weights at M <= 16, where 4x the CTAs of the shared-A tile keep the GPU busy
//      shared-A (kbit_gemm_shared_a_kernel): 2..5 = MB 1, 2, 4, 8; MT = 2, 8 warps along n, 256-row CTAs,
//        the A tile of a k-step staged once per CTA (section 4); MB 8 ("wide") takes the SM alone;
//        MB 2 also serves M <= 128 (k = 5: 64) for small weights, which stay in L2 across token tiles;
//        8, 9 = configs 2, 3 with WARPS_K = 2 (4 warps along n, 128-row CTAs, each k warp a contiguous half of
//        the CTA's k-steps): twice the tiles, half the split-K splits, where many short splits make the
//        reduction weigh (section 5); 10 = config 2 with 7 warps (224-row CTAs), where 256-row tiles x whole
//        splits leave SM slots idle (14336 x 4096: 256 CTAs of 224 rows instead of 224 of 256 on 264 slots);
//        11 = config 3 as 16 warps (4 along n x 4 along k, 128-row CTAs, one per SM, sm_90): where its tiles fill
//        3/4 to all of the SMs it needs no split-K (14336 x 4096 at M = 16: 112 CTAs, 5% faster than config 3), and
//        in place of config 3's many splits (>= 12; k = 5) where its CTAs fill 70% of the SMs; at M = 17..32 (two token
//        tiles on the grid) where its CTAs fill 90-100% of the SMs with 4-8 k-steps per k warp; 12 = config 2 as 8
//        warps along k (32-row CTAs): one token at k = 3, 4 where it needs 1 or 2 splits in one even wave and each k warp
//        a chunk of <= 7 k-steps (4096 x 14336 k = 3: 256 CTAs in 2 splits pushed through clusters, 12.0 -> 11.3 us)
//        (the dispatcher's rules and their measurements over 22 LLM shapes: kbit_gemm.cu select_config, docs/kernel.md)
//      wgmma (kbit_gemm_wgmma_kernel, sm_90a, its own design block in kbit_gemm_wgmma.cuh): 6 = 64 tokens,
//        16 warps of one unit each, 256-row CTAs: the wide tile with wgmma, for M > 32 on Hopper, and at M = 17..32 where
//        configs 3 and 4 would fill under 90% of their CTA slots
//      warp-specialised wgmma (kbit_gemm_wgmma_ws_kernel, sm_90a, kbit_gemm_wgmma_ws.cuh): 7 = 128 rows x 256
//        tokens, a producer warp (bulk copies + TMA) and 2 consumer warpgroups, for M = 129..2048 on Hopper
//          k:  0         128        256   ...      K_pad
//        n 0   +----------+----------+----
//              | unit     | unit     |      config 0 CTA: rows 0..63 = warps wn 0,1 (32 rows each);
//          16  +----------+----------+          k-steps split in 4 contiguous chunks (wk 0..3)
//              | unit     | unit     |      per warp and k-step: MT x 8 MMAs per token tile
//
// 3. Fragment ownership (lane = 4*g + t, g = lane/4, t = lane%4)
//    A-operand (weights) a0..a3 = half2 at (row g, slots 2t,2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)
//    B-operand (acts)    b0, b1 = half2 at (slots 2t,2t+1 ; token g), (slots 2t+8,2t+9 ; token g)
//    D                   d0..d3 = (n g, tok 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
//    Slot = real k: a lane dequantizes, of each block, the 4 "pairs" (k 8p+2t, 8p+2t+1), p = 0..3 (k16 step
//    p / 2, slots 2t + 8 (p % 2)), of rows g and g+8, and needs the same k of its token g: its B fragments
//    of a block are the four 8 x 8 matrices (8 tokens x k 8j..8j+7) that one ldmatrix.x4 reads from a token
//    tile in shared memory (row-major, a row of 16-byte chunks per token). The tiled layout used to permute
//    k inside each block instead (lane t: real k 8t..8t+7, one 16-byte load of A per token and block), so
//    that the wgmma configs, whose tensor core reads the tokens from shared memory in real k order, had to
//    transpose the weight fields among lanes or permute the tokens first (config 7, ~3% of a call at k = 4,
//    5-8% at k = 5). ldmatrix costs the mma.sync configs nothing: H100, us, timing-only build, LDS.128 ->
//    ldmatrix (rows padded by 16 bytes instead of 64), M = 16, k = 2 / 3 / 4: 14336 x 4096 14.7 / 16.8 / 17.9 ->
//    14.4 / 16.5 / 17.6, 4096 x 14336 15.2 / 17.3 / 18.4 -> 14.7 / 16.8 / 17.9; M = 1 and 32 within 0.1-0.3.
//    Dequant of a pair: e = LUT index (2*K_BITS bits), one LDS.32 of a half2 {cb[i0]*F, cb[i1]*F}
//    from a LUT duplicated LUT_COPIES times (copy = lane % LUT_COPIES: bank-conflict free for 32
//    copies; k = 5 has 1024 entries: 4 copies in configs 0-1, 8 in the shared-A configs with smem weight
//    rings, where the 32 KB table still leaves 2-3 ring stages: H200 8192 x 28672 M=1 87.2 -> 82.7 us,
//    M=32 105.7 -> 101.8; 16 in configs 2-3, whose weights skip smem: H100 M=1 28672 x 8192 74.8 -> 61.5),
//    then one HMUL2 by the block scale {s, s}. k = 2 looks up a QUAD (the fields of MMA registers
//    2h and 2h + 1, one byte of a lo word) in a 256-entry table of 8-byte entries, 16 copies (an LDS.64
//    is served per half warp), 32 KB: one shift + LOP3 + LDS.64 per 4 weights, and the two halves land
//    in consecutive registers as the MMA wants them (pairs 2h, 2h+2 would cost a move each: 364 vs 306
//    instructions per k-step). H200 M = 1: 28672 x 8192 48.3 -> 46.0 us, 8192 x 28672 43.1 -> 41.5.
//    k = 3 at MB = 1 applies the scale in fp32 after the MMA instead (POST_SCALE, KbitGemmConfig).
//    One token (M = 1, configs 2, 8, 10, k <= 4: BLOCK_COLUMNS) uses the 7 idle token columns: block b of a
//    k-step is multiplied into column b alone: in block b's two MMAs lane (g, t) passes block b's activations as its
//    B fragment where g = b and zeros elsewhere, so each MMA adds its block into one column and leaves the others;
//    the LUT holds bare codebook values (x 16) and after a k-step's 8 MMAs per unit d[n g][col 2t, 2t+1] are the
//    unscaled sums of blocks 2t, 2t+1 (t >= 2: empty columns), scaled with 4 FFMA per unit in fp32; after the loop
//    2 shuffles per row sum the columns. The A slot is the k-step's one token row with each block's 16 words in
//    quad-major order (word 4j + t at 4t + j), so lane (g < 4, t) reads its block's four B registers with one
//    LDS.128 per k-step (2 shared-memory wavefronts per warp) and 16 SEL zero them outside block g's MMAs.
//      k-step:   block 0    block 1    block 2    block 3          D (16 rows x 8 columns), per k-step
//      B column  0: a0      1: a1      2: a2      3: a3            col 0 += W[:, blk 0] a0 ... col 3 += ...
//               (columns 4..7, and column g outside block g: 0)     acc[n][c] += s[n][blk c] * D[n][c]
//    That drops the 32 HMUL2 and 8 scale pairs per unit and k-step (k = 4: 706 -> 680 loop instructions per
//    2 k-steps, 798 with HMUL2). H100, M = 1, us, HMUL2 / lanes masking a broadcast A / a diagonal slot (block b in
//    row b, 4 ldmatrix.x4 per k-step), k = 2: 14336 x 4096 11.3 / 11.0 / 11.0, 28672 x 8192 33.4 / 32.3 / 32.2;
//    k = 3 (POST_SCALE before): 39.9 / 39.5 / 38.5; k = 4 46.2 / 45.5 / 45.6; k = 5 55.6 / 55.4 / 55.5 (not taken).
//    The diagonal's ldmatrix.x4 cost 16 wavefronts per warp and k-step against the table's 64 (2 units), in a loop
//    whose shared-memory pipe is ~75% busy; one LDS.128 instead (2026-11-26), H100, us, dispatcher's plans, two
//    passes, k = 2 / 3 / 4: 4096 x 14336 10.2 / 11.8 / 13.4 -> 9.3 / 11.9 / 12.9, 8192 x 8192 10.6 / 12.9 / 14.4 ->
//    9.6 / 12.7 / 14.1, 14336 x 4096 10.3 / 12.0 / 13.1 -> 9.9 / 12.3 / 12.9, 8192 x 28672 28.6 / 36.5 / 44.4 -> 26.5
//    / 36.8 / 43.8, 28672 x 8192 29.7 / 38.0 / 44.6 -> 28.7 / 39.2 / 44.3 (docs/kernel.md "The one-token A slot").
//    The repack (TiledFormat) stores each lane's pair indices e as contiguous 2k-bit fields of its 2k words, so
//    the LUT address is one shift (a funnel shift for the k = 3, 5 fields that straddle two words) + one LOP3.
//    E4M4 scales need no decode arithmetic: the bits (code << 6) ARE an fp16 equal to absmax / 16
//    (code << 3: a bf16 equal to absmax * 2^-116, subnormals included); F = 16 (or 2^116) is
//    folded into the LUT. fp16 absmax: F = 1 (bf16 compute converts the scale through fp32). A lane's 4 codes of a
//    row half share one word: one rotation + mask gives the half2 {s0, s2}, the other {s1, s3}, and each HMUL2 takes
//    its scale as a .H0_H0 / .H1_H1 operand (scale_pair): 4 instructions per 4 scales, 2-5% fewer in the loops
//    (H100, M = 16, k = 3: 14336 x 4096 16.1 -> 15.8 us, 4096 x 14336 16.15 -> 15.9; M = 1 (block columns) unchanged).
//
// 4. Pipeline
//    Configs 0-2 (per warp, no CTA barrier in the main loop): each lane cp.async-copies exactly the
//    weight words and absmax it will itself read into its warp's private ring (depth chosen at
//    launch, 2..6 stages, from the smem left after the LUT), so cp.async.wait_group alone orders it.
//    stages-1 k-steps are in flight while one is dequantized. MB = 1: the A rows of the k-step travel
//    in the same ring stage (lane (g, t) copies 16-byte chunk t of each block of token g, chunks swizzled
//    so ldmatrix is conflict-free, __syncwarp before the reads; k >= K_dim zero-filled);
//    MB >= 2: A is loaded into registers one k-step ahead (L1 shared by the WARPS_N warps; four 4-byte loads
//    per token and block, the words of the lane's pairs).
//    Shared-A configs: ONE A ring per CTA ([8*MB tokens][128 k], rows padded by 16 B so the ldmatrix
//    fragment reads are conflict-free), one __syncthreads per k-step (wait step i, barrier, refill the
//    slot of step i-1, compute step i; per 2 k-steps with register weights, below); 2-4 stages in
//    112 KB (MB 1-4, two CTAs per SM) or 226 KB (MB 8).
//    Each dequantized fragment feeds MB MMAs. The weights: MB = 4, 8 use the per-warp smem rings above;
//    MB = 1, 2 (M <= 16) keep them in registers instead (W_REG_STAGES = 2, 2; 3 for k = 2 in configs 2, 10): each lane loads its own
//    words and scales with ld.global.nc.L1::no_allocate into a ring of that many k-steps, refilling a
//    slot right after the compute that used it (the loop is unrolled by the depth, so every slot is a
//    fixed set of registers). That drops the cp.async write, the LDS read back and the ring's wait from
//    the loop: ~35% of its shared-memory traffic at k = 4, whose bandwidth is what bounds M = 1 (7).
//    With their weights in registers the CTA barrier is only for A, so these configs refill A two
//    k-steps at a time (A_STEPS_PER_BARRIER = 2, 4 slots): one barrier per 2 k-steps lets a warp that is
//    late on one step's weights catch up before the others wait. H100, us, a barrier per step -> per 2
//    steps: 28672 x 8192 M=16 k=2 47.1 -> 44.6, k=4 57.7 -> 56.6, k=5 84.3 -> 82.5; 8192 x 28672 M=16
//    k=4 55.2 -> 52.9; M=1 1-2%. 6 slots (2 per barrier) and 8 (4 per barrier) were 0-2% slower than 4.
//    Without any barrier (a timing-only build, racing on A) M=1/16 k=2 was 6% faster than per step. But each lane
//    reading its A straight from global memory (L1-cached LDG.128 per block, no A ring, no barrier in the loop;
//    configs 2 and 10) was 3-8% slower: H100, us, M=1, k = 2 / 3 / 4 / 5, 14336 x 4096 12.2 / 14.3 / 16.0 / 19.0
//    -> 13.1 / 14.8 / 17.4 / 21.0, 8192 x 8192 13.1 / 15.5 / 17.8 / 21.8 -> 14.1 / 16.3 / 19.0 / 23.1 (28672 x
//    8192 k=3 43.3 -> 42.7 the one gain); M=4 alike.
//
// 5. Work decomposition and split-K (every config, M <= 256; shared-A configs have WARPS_K = 1 but 8, 9 and 11)
//    k-steps of grid split s: [s*ks_per_split, ...); inside: WARPS_K contiguous chunks.
//    Example K_pad = 4096 (32 k-steps), k_splits = 2, WARPS_K = 4: split 0 = steps 0..15, warp
//    wk = 0..3 gets steps 4wk..4wk+3 of it. Epilogue: warps wk > 0 write fp32 partials to smem, warp
//    wk = 0 adds them in wk order; with k_splits = 1 it stores C (+bias). With k_splits > 1 every
//    split writes its partial tile to workspace slot [tile][split]; after a CTA barrier thread 0 adds 1
//    to the tile's counter with one acq_rel atomic (release of the CTA's slot, acquire of the others'
//    slots, ordered for every thread by the barriers around it: no per-thread __threadfence, which cost
//    0.3-0.6 us per call at M = 1 on H100); the last arriving CTA sums the slots in split order
//    0..k_splits-1 (bitwise deterministic, independent of arrival order), stores C and resets the
//    counter to 0. The counters sit at the start of the workspace, which must be zeroed ONCE at
//    allocation; one workspace must not be used by two GEMMs running concurrently (different streams).
//    k_splits = floor(CTA slots / CTAs) (one wave), capped by k-steps and the workspace size.
//    That tail (fence, counter, slot reads: L2 round trips while other CTAs stream) is 11-20% of an 8B-shape call at
//    M = 1 and 16 (H100, k = 3, M = 16, 4096 x 14336: 17.3 us, 13.8 with every split only storing its slot).
//    Slower, measured: the sum in a second kernel (1.2-3.7 us per call); slots that read 0 between calls, with a
//    relaxed counter per CTA or per warp (no fence; M = 16 up to 34% slower); the splits of a tile as one thread-block
//    cluster summing through DSMEM (M = 1 up to 6.6 us slower: clusters of 4-16 CTAs are placed within a GPC and fewer
//    are resident at once; where all fit, 0.1-0.6 us faster); pushing pairs of splits (4-8 splits) through 2-CTA
//    clusters before the workspace: as fast or slower. Counters 128 B apart: no change.
//    docs/kernel.md "The split-K tail taken apart".
//    Kept: the shared-A configs launch 2-split plans on sm_90 as 2-CTA clusters where all are resident: split 1's
//    k-reduced warps store their partial into split 0's shared memory with st.async and leave, split 0 waits on an
//    mbarrier for the bytes and stores C (push_split_k): no workspace, fence or counter; the same sum, split 0 +
//    split 1. H100, M = 1, k = 2: 14336 x 4096 9.6 -> 8.9 us, 8192 x 2048 5.2 -> 4.2 (kbit_gemm.cu,
//    split_k_push_max_splits).
//    Configs 8, 9, 11 (shared-A, WARPS_K = 2, 2, 4): the A slot of a CTA step holds the k-step of each k warp's chunk
//    (k_begin + wk * chunk + i); where a split's k-steps are odd the second chunk is one shorter and its warp
//    multiplies its stale weight registers by zero-filled A for that step (a branch around the compute instead
//    cost 5-30%: ptxas then no longer overlapped consecutive steps).
//    Consecutive calls overlap (configs 0-5, 8-11; programmatic dependent launch, sm_90): a kernel waits for the
//    previous one (griddepcontrol.wait) before its first global access and lets the next one launch once its
//    loads are issued (after the k-loop; the register-weight loop at its last k-step), so the next call's CTAs
//    fill the slots of this call's split-K tail: H100 back to back, M = 1 0-9% faster (14336 x 4096 k = 2 12.5
//    -> 11.8 us; 4096 x 4096 k = 3 7.3 -> 6.6 for the last-step trigger), no change after a plain kernel
//    (kbit_gemm.cu, pdl_enabled).
//    Before the wait, one-token-tile CTAs prefetch their first k-steps into L2 (a hint, safe there; 2 with >= 8
//    k-steps per warp, 1 with 4-7): back to back another 2-9% (14336 x 4096 k = 3 14.0 -> 13.2 us, 4096 x 14336
//    14.2 -> 13.3) (kbit_gemm.cu, l2_prefetch_steps).
//
// 6. Invariants: K_dim % 32 == 0, M, N >= 1, lda >= K_dim (launcher); tiled N padded to 16 and K to
//    128 with zero absmax (repack); A beyond K_dim is zero-filled, A rows >= M and weight rows >= N
//    only ever feed output elements that are not stored; B_packed 16-byte aligned (cudaMalloc);
//    A may have any alignment / lda (16-bit load fallback). Smem: configs 0-4 <= 112 KB (two CTAs
//    per SM on sm_90), wide 226 KB (sm_90 only: the dispatcher checks the device opt-in limit).
//
// 7. Why (estimates first, then measurements; tables in dev/gemm_harness/NOTES.md)
//    M = 1 on H100: ~3.35 TB/s HBM vs ~132 SMs x 4 x 32 lanes x 1.75 GHz = 30e12 lane-ops/s; k = 4
//    at 0.53 B/weight -> 6.3e12 weights/s -> ~4.7 lane-ops per weight. Per-element bit-plane
//    extraction (K_BITS x (shift, and, or)) + shfl = ~14 ops/weight: cannot reach 60%. Pair LUT +
//    HMUL2 = ~2 ops/weight, leaving room for loads/addressing.
//    Measured (H200, copy BW 3.97 TB/s, fp16, E4M4, k = 4, M = 1): 40% of the byte floor at
//    N=14336 K=4096 (19.6 us), 60% at N=8192 K=28672 (51.9 us); 1.6-2.2x faster than cuBLAS fp16.
//    ncu (N=14336 K=4096): ~0.55 IPC per SMSP, 4.5 lane-instructions per weight (SASS: ~5.6 per
//    pair in the dequant loop), stalls wait / long scoreboard / not selected, 63% SM-active time
//    (224 CTAs on 264 slots, launch + pipeline fill): per-SM issue and wave quantization bound it.
//    Measured and rejected:
//    - A through registers one k-step ahead for M <= 4: same speed as A in the ring (20.5 us); the
//      ring needs fewer registers and exposes no global latency, kept. For M = 16 per-warp A copies
//      cost a CTA per SM (40.9 vs 25.7 us), so MB >= 2 keeps A in registers.
//    - recomputing unit addresses per k-step: ~40% of the loop's instructions; pointer increments.
//    - A copies of the MB = 1 ring with per-block K_dim checks: ~48 of ~520 instructions per k-step;
//      a check-free path for k-steps inside K_dim takes ~20 (no measurable change at M = 1, kept).
//    - a byte-indexed 64 KB LUT (one PRMT per pair address instead of shift + LOP3) in 16-warp CTAs:
//      fewer instructions, not faster (N=14336 K=4096: 23.6 vs 20.8 us, 1.7 waves at one CTA per SM;
//      N=8192 K=28672: 50.0 vs 52.2 us). Removed. Retried in the shared-A MB = 1 config (2 stages
//      left in 112 KB): ptxas kept the table base in a vector register and added it per pair
//      (PRMT + IADD + LDS), so the loop stayed at ~420 instructions per k-step; not pursued.
//    - 32-row CTAs for small weights: no gain (N=4096 K=4096: 11.9 vs 10.9 us). Removed.
//    - A in registers for 4 token tiles per warp (a former config): 0.13x cuBLAS at M >= 128, and at
//      M = 32 slower than the 32-token shared-A tile (N=14336 K=4096: 45.8 vs 27.1 us). Per-warp
//      register A also lost to shared A at M = 5..16 on large weights (28.7 vs 22.0 us): each warp
//      loaded 16 bytes per token tile and block through L1, twice the weight bytes at M = 16.
//    - MB = 1 with 128-row CTAs, three per SM (24 warps, 73 KB each): 1-6% slower than two 256-row
//      CTAs per SM, so occupancy is not what bounds M = 1. Again with the weights in registers, config 3
//      as MT = 1, 128-row CTAs, three per SM (72-80 registers, no spills): M = 16 slower everywhere (H100,
//      us, k = 2 / 3 / 4 / 5: 14336 x 4096 14.8 / 16.8 / 18.1 / 21.6 -> 16.9 / 19.2 / 19.8 / 29.5, 28672 x 8192
//      44.5 / 53.6 / 56.1 / 71.8 -> 54.8 / 74.4 / 76.5 / 78.4): twice the A fragment loads per weight.
//    - stream-K for the shared-A configs (one CTA per slot, equal shares of tiles x k-steps, a CTA
//      spanning two tiles parks the first partial and arrives on both counters at its end): H200
//      k = 4, 28672 x 8192 M=1 56.7 -> 53.5 us (split-K filled 224 of 264 slots), but 14336 x 4096
//      18.6 -> 19.3, 8192 x 8192 19.1 -> 21.2 and 4096 x 14336 (17 CTAs per tile) 18.3 -> 23.7 at
//      M = 1, and slower at M = 16 and 64 too. Grid split-K kept.
//    - resident A for configs 9 and 11 (a CTA's whole A in shared memory, one slot per k-step filled by per-row
//      bulk copies on its own mbarrier, no CTA barrier in the loop; branch exp/resident-a): H100, M = 16, k = 2,
//      14336 x 4096 13.6 -> 17.1 us, 8192 x 8192 14.3 -> 17.6. Timing-only builds without the table reads, 7 of 8
//      ldmatrix and the A refills (KBIT_PROBE_NO_TABLE, _ONE_LDMATRIX, _NO_A_REFILL) took M = 16, k = 2 only to
//      12.3-13.0 us: shared memory is not what bounds M = 16 (docs/kernel.md "M = 16 without its shared-memory reads").
//    - the wide config reaches 0.37x cuBLAS at M = 4096; above 256 tokens the staged path (dequantize
//      + cuBLAS, backends/cuda/ops.py) runs instead, and on Hopper config 7 up to M = 2048.
//    - more split-K (the SM count overridden so splits = 3..8 on 28672 x 8192 M=1): k = 2 48.5 -> 44.1 us
//      at 8 splits, k = 4 56.5 -> 55.6, and 14336 x 4096 / 8192 x 8192 slower (up to 1.4x): not taken.
//    - 5 ring stages (k = 2, 3 fit them in 112 KB): no change; one 226 KB CTA per SM with 8 stages: 3-8%
//      slower; MT = 4 (512-row CTAs, one per SM): 0-5% slower.
//    - a 16-copy pair table for k = 3, 4 (16 KB, lanes l and l+16 share a copy): 20-28% slower (k = 4
//      28672 x 8192 M=1 57.5 -> 73.5 us): shared-memory bandwidth is what the loop spends.
//    Where M = 1 goes (H200, 28672 x 8192, shared-A MB = 1; leave-one-out builds, KBIT_PROBE_NO_LOADS /
//    KBIT_PROBE_NO_COMPUTE in the shared-A kernel, dev/build_variant.sh): k = 2 full 46.4 us, without the
//    ring refills 37.3, without the dequant/MMA 24.7 (floor 15.6); k = 4: 57.6, 40.0, 40.5 (floor 29.5).
//    So the dequant alone runs at ~45% issue (ncu: 0.57 IPC per scheduler, stalls spread over wait,
//    short scoreboard, MIO, math pipe, barrier), the copy alone at 63-73% of DRAM bandwidth, and they
//    only partly overlap. Shared memory per warp and k-step: 8 KB of LUT reads, ~2 KB of weight ring
//    writes + reads each, A fragments: ~1800 of the ~2300 cycles per k-step (both CTAs) at 128 B/clk.
//    Reading A rows < M only (lanes of rows >= M share the last row, so the fragment read broadcasts) took
//    k = 2 M=1 47.9 -> 44.7 us and k = 4 57.3 -> 54.5.
//    Weights in registers (section 4), H100, us, smem ring -> registers, each pair from one call:
//      M = 1 (3 k-steps deep), 28672 x 8192: k = 2 44.4 -> 38.5, k = 3 60.9 -> 55.7, k = 4 56.5 -> 51.6,
//      k = 5 90.8 -> 77.7; 8192 x 28672: 40.2 -> 35.3, 55.0 -> 51.1, 57.3 -> 50.5, 80.7 -> 70.3;
//      14336 x 4096: 16.0 -> 14.2, 20.3 -> 19.1, 18.5 -> 17.8, 27.7 -> 25.3. Four k-steps deep: k = 4
//      28672 x 8192 55.6 (and k = 5 spills). M = 16 (config 3), 28672 x 8192: 2 deep k = 2 53.4 -> 47.1,
//      k = 4 65.2 -> 58.1, k = 5 98.4 -> 85.0 (3 deep: 47.5, 58.8, 88.8); 14336 x 4096 19.7 -> 17.3,
//      22.0 -> 20.3, 30.4 -> 27.3. A register codebook for k = 2 (PRMT from two registers instead of LUT
//      reads) was then costed and is slower (docs/kernel.md).
//    Prologue and epilogue (ncu per-instruction stall sampling, dev/ncu_stalls.py; docs/kernel.md "Where
//    the time goes"): the codebook load goes first (build_lut), config 2 copies A before its weights
//    (shared_a_loop_weight_regs), and split-K arrives with one acq_rel atomic per CTA (section 5): H100
//    M = 1 14336 x 4096 k = 2 14.4 -> 12.5 us, 8192 x 8192 k = 5 26.8 -> 24.4. Not kept: three CTAs per
//    SM for config 2 (slower everywhere), split-K through thread-block clusters (slower but for config 6).
//
// Naming: g_ global, s_ shared, r_ registers; frag_a (weights), frag_b (acts), acc.
// ============================================================================================
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <type_traits>

namespace kbit {

// ---------------------------------------------------------------------------------------------
// Tiled layout (owned here; mirrored by bitsandbytes_kbit/backends/default/tiled_layout.py)
// ---------------------------------------------------------------------------------------------
constexpr int BLOCK_ELEMS = 32;                      // quantization block along K_dim
constexpr int UNIT_ROWS = 16;                        // rows n per unit (= MMA m16)
constexpr int UNIT_K = 128;                          // k per unit (one k-step)
constexpr int UNIT_BLOCKS = UNIT_K / BLOCK_ELEMS;    // 4 quantization blocks per unit row
constexpr int UNIT_ABSMAX = UNIT_ROWS * UNIT_BLOCKS; // 64 absmax entries per unit
static_assert(UNIT_K % BLOCK_ELEMS == 0, "a unit must hold whole quantization blocks");

// Per k-bit width: how a lane's 2*K_BITS words per unit hold its 32 pair fields.
//   pair q = 4*u + j, u = 2*blk + s (MMA k16 step), j = MMA register (0: row g, pair 2s; 1: row g+8,
//   pair 2s; 2: row g, pair 2s+1; 3: row g+8, pair 2s+1). A pair = elements (8p+2t, 8p+2t+1) of its block: the
//   k the MMA register fragment puts there (section 3), so every config reads the tokens in their own order.
//   The pair's field is its LUT index e (FIELD_BITS = 2 K_BITS bits) at bits [q FIELD_BITS, + FIELD_BITS)
//   of the lane's words read as one 64 K_BITS-bit little-endian stream (word w = stream bits 32w..32w+31);
//   for k = 3, 5 a field may straddle two words (one funnel shift reads it). Every k thus needs one shift + one
//   LOP3 per LUT address; the former odd-k split (a low-bits field + a 2-bit top-bits field in other words) needed
//   two of each: H100 M = 1 k = 3, us, 14336 x 4096 18.1 -> 14.8, 28672 x 8192 55.3 -> 44.0 (docs/kernel.md).
//   e = lo | hi << LO_FIELD_BITS: lo = the LO_BITS_PER_ELEM low index bits of elem0, then of elem1; hi
//   (k odd) = the top index bit of elem0 (bit 0) and of elem1 (bit 1).
//   k = 2: byte b of word w holds pairs q = 8w + 2b and + 1, i.e. MMA registers 2h and 2h + 1 of MMA u
//   (q = 4u + 2h): one "quad" the GEMM looks up at once into two consecutive registers.
template <int K_BITS> struct TiledFormat {
    static_assert(K_BITS >= 2 && K_BITS <= 5, "K_BITS must be 2..5");
    static constexpr int LO_BITS_PER_ELEM = K_BITS >= 4 ? 4 : 2;
    static constexpr int LO_FIELD_BITS = 2 * LO_BITS_PER_ELEM;          // 4 or 8
    static constexpr int FIELD_BITS = 2 * K_BITS;                        // one pair's LUT index
    static constexpr int PAIRS_PER_LANE = 32;                            // 2 rows x 4 blocks x 4 pairs
    static constexpr int LANE_WORDS = PAIRS_PER_LANE * FIELD_BITS / 32;  // = 2 * K_BITS
    static constexpr int LUT_ENTRIES = 1 << (2 * K_BITS);
    static constexpr int UNIT_WORDS = 32 * LANE_WORDS;                   // 64 * K_BITS
    // a lane's words are stored as NV4 uint4 chunks then (if LANE_WORDS % 4) one uint2 chunk,
    // each chunk lane-major so a warp-wide 16 (8) byte access is contiguous.
    static constexpr int NV4 = LANE_WORDS / 4;
    static constexpr int HAS_V2 = (LANE_WORDS % 4) != 0;
    static_assert(LANE_WORDS % 2 == 0, "tail chunk is one uint2");
    static constexpr bool QUAD = K_BITS == 2;
};

// word offset inside a unit of lane word lw of lane `lane`
template <int K_BITS> __host__ __device__ inline int unit_word_offset(int lane, int lw) {
    using F = TiledFormat<K_BITS>;
    return lw < 4 * F::NV4 ? (lw / 4) * 128 + lane * 4 + (lw % 4) : F::NV4 * 128 + lane * 2 + (lw - 4 * F::NV4);
}

// The fields every reader of a tiled weight has (KbitGemmParams, TiledWeight), filled in one place.
template <class W>
inline void set_tiled_weight(W& w, const void* B_packed, const void* B_absmax, const float* codebook, int codebook_len,
                             int N, int K_dim) {
    w.B = reinterpret_cast<const uint32_t*>(B_packed);
    w.B_absmax = B_absmax;
    w.codebook = codebook;
    w.codebook_len = codebook_len;
    w.N = N;
    w.K_dim = K_dim;
    w.k_steps = (K_dim + UNIT_K - 1) / UNIT_K;
    w.n16_tiles = (N + UNIT_ROWS - 1) / UNIT_ROWS;
}

constexpr bool cp_async_wait_groups_supported(int n) { return n >= 0 && n <= 5; }
constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x / 2); }

// ---------------------------------------------------------------------------------------------
// Kernel configuration
// ---------------------------------------------------------------------------------------------
// SHARED_A_: the base of a KbitSharedAConfig (its own ring; the per-warp ring constants are unused)
template <int K_BITS_, int MB_, int MT_, int WARPS_N_, int WARPS_K_, bool ABS_U8_, bool SHARED_A_ = false,
          bool BLOCK_COLUMNS_ = false>
struct KbitGemmConfig {
    static constexpr int K_BITS = K_BITS_;
    static constexpr int MB = MB_;           // n8 token tiles per warp
    static constexpr int MT = MT_;           // 16-row units per warp
    static constexpr int WARPS_N = WARPS_N_; // warps along n (different rows, same k)
    static constexpr int WARPS_K = WARPS_K_; // warps along k (same rows), reduced in smem
    static constexpr bool ABS_U8 = ABS_U8_;
    using Fmt = TiledFormat<K_BITS>;

    static constexpr int WARPS = WARPS_N * WARPS_K;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int TILE_M = 8 * MB;              // tokens per CTA
    static constexpr int TILE_N = UNIT_ROWS * MT * WARPS_N; // rows n per CTA
    static constexpr int ABS_BYTES_PER_LANE = ABS_U8 ? 8 : 16; // rows g, g+8 x 4 blocks

    // per-warp ring stage: [Fmt::LANE_WORDS x 32 lanes] words per unit, then absmax
    static constexpr int STAGE_W_WORDS = MT * Fmt::UNIT_WORDS;
    static constexpr int STAGE_ABS_WORDS = MT * 32 * ABS_BYTES_PER_LANE / 4;
    // A of one k-step: [UNIT_BLOCKS][a_rows][4 chunks][16 bytes], chunk c of row r at c ^ a_chunk_swizzle(r);
    // a_rows = min(M, TILE_M) at run time.
    // Only for one token tile (MB = 1): wider tiles keep A in registers one k-step ahead, because
    // per-warp copies of 16+ rows cost the smem of a second CTA per SM (H200, N=14336 K=4096 M=16
    // k=4: A in ring 40.9 us, A in registers 25.7 us).
    static constexpr bool A_IN_RING = MB == 1;
    static constexpr int A_WORDS_PER_ROW = A_IN_RING ? UNIT_BLOCKS * 16 : 0;
    // LUT: k = 3..5 a pair table (entry = one half2 / bf162), k = 2 a quad table (entry = two of them,
    // read with one LDS.64: 256 entries). Copies: one per lane (conflict-free) for k = 3, 4; 16 for the
    // quad table (an LDS.64 is served per half warp); k = 5 has 1024 entries: 4 copies (16 KB) in the
    // per-warp configs, 8 (32 KB) in the shared-A ones with weight rings in smem, 16 (64 KB) in the register-
    // weight configs 2 and 3, whose smem holds only the table and A (lanes l, l + 16 share a copy: 2-way
    // conflicts at most, against 4-way with 8). H100, us, 8 -> 16 copies: M = 1 14336 x 4096 23.9 -> 20.3,
    // 28672 x 8192 74.8 -> 61.5, 4096 x 14336 23.3 -> 20.9; M = 16 26.3 -> 23.4, 81.8 -> 68.0, 26.6 -> 24.3
#ifndef KBIT_K2_PAIR_LUT // 1: k = 2 looks up pairs in a 16-entry table (2 KB to build), as k = 3..5 (dev/build_variant.sh)
#define KBIT_K2_PAIR_LUT 0
#endif
    static constexpr bool QUAD_LUT = Fmt::QUAD && !KBIT_K2_PAIR_LUT;
    // build_lut: one entry per thread (shared-A and wgmma configs) or one 16-byte chunk per thread (per-warp configs)
    static constexpr bool LUT_BUILD_BY_ENTRY = SHARED_A_;
    static constexpr int LUT_ENTRIES = QUAD_LUT ? 256 : Fmt::LUT_ENTRIES;
    static constexpr int LUT_ENTRY_BYTES = QUAD_LUT ? 8 : 4;
#ifndef KBIT_K5_LUT_COPIES_REG // k = 5 table copies of the register-weight configs (dev/build_variant.sh)
#define KBIT_K5_LUT_COPIES_REG 16
#endif
    static constexpr int LUT_COPIES = QUAD_LUT ? 16 : K_BITS <= 4 ? 32 : SHARED_A_ && MB <= 2 ? KBIT_K5_LUT_COPIES_REG : SHARED_A_ ? 8 : 4;
    static constexpr int LUT_WORDS = LUT_ENTRIES * LUT_COPIES * LUT_ENTRY_BYTES / 4;
    static constexpr int LUT_STRIDE_LOG2 = ilog2(LUT_COPIES * LUT_ENTRY_BYTES); // bytes per entry (all copies)
    static_assert((1 << LUT_STRIDE_LOG2) == LUT_COPIES * LUT_ENTRY_BYTES, "LUT stride = copies x entry bytes");
    // POST_SCALE: the block scale is applied in fp32 after the MMA (per block: 2 MMAs into a zeroed
    // fragment, then 4 FFMA per token tile) instead of one HMUL2 per pair (16 per block). At MB = 1 the
    // loop is 32 instructions per k-step shorter, but the HMUL2s run on the FMA pipe, which is not what
    // bounds the loop (section 7): H200 M = 1, us, with / without: k = 3 28672 x 8192 59.4 / 60.6,
    // 8192 x 28672 53.4 / 54.6; k = 4 57.5 / 55.4, 51.3 / 50.1; k = 2 46.8 / 46.0. Kept for k = 3 only.
    // Again with the weights in registers (H100, us): k = 2 38.2 / 38.1, k = 4 51.4 / 50.7, k = 5 79.4 / 76.9.
    // k = 2 at two token tiles (M = 9 / 16, H100, us, without / with): 14336 x 4096 12.5 / 13.1-13.2 and 13.3 /
    // 13.7-13.8, 4096 x 14336 13.1-13.2 / 13.4-13.5 and 14.0-14.1 / 14.3-14.4, 8192 x 8192 13.4-13.5 / 14.1-14.3
    // and 14.4 / 15.0-15.1 (docs/kernel.md "The tensor pipe at M = 16").
#ifndef KBIT_POST_SCALE_MAX_MB // POST_SCALE up to this many token tiles (dev/build_variant.sh)
#define KBIT_POST_SCALE_MAX_MB 1
#endif

    // BLOCK_COLUMNS (M = 1, one-tile shared-A configs): block b of a k-step is multiplied into token column b
    // (section 3), the scale applied per k-step in fp32
    static constexpr bool BLOCK_COLUMNS = BLOCK_COLUMNS_;
    static_assert(!BLOCK_COLUMNS_ || (SHARED_A_ && MB_ == 1), "block columns: one token tile, shared A");
    static constexpr bool POST_SCALE = !BLOCK_COLUMNS && MB <= KBIT_POST_SCALE_MAX_MB && K_BITS == 3;
    // E4M4 and POST_SCALE: the scale is the code's bits << 19 as an fp32 (= absmax * 2^-116, exact,
    // subnormals included), the LUT holds codebook * 16, so acc = C * 2^-112 until the store
    static constexpr float OUT_FACTOR = ABS_U8 && (POST_SCALE || BLOCK_COLUMNS) ? 5.192296858534828e33f : 1.0f; // 2^112
    // smem: two CTAs per SM (2 x (112 + 1 reserved) KB fit H100/H200's 228 KB and A100's 164 KB per
    // CTA limit); a 16-warp CTA would take the SM alone (226 KB, sm_90 only)
    static constexpr int CTAS_PER_SM = WARPS >= 16 ? 1 : 2;
    static constexpr int SMEM_BUDGET_BYTES = CTAS_PER_SM == 1 ? 226 * 1024 : 112 * 1024;
    static constexpr int SMEM_BYTES_MAX = SMEM_BUDGET_BYTES; // every launch asks for at most this
    // ring depth is chosen at launch from a_rows (fewer A rows leave room for more stages)
    static constexpr int MAX_STAGES = 6;
    static __host__ __device__ constexpr int stage_words(int a_rows) {
        return STAGE_W_WORDS + STAGE_ABS_WORDS + a_rows * A_WORDS_PER_ROW;
    }
    static __host__ __device__ constexpr int stages_for(int a_rows) {
        return (SMEM_BUDGET_BYTES / 4 - LUT_WORDS) / (WARPS * stage_words(a_rows)) > MAX_STAGES
                   ? MAX_STAGES
                   : (SMEM_BUDGET_BYTES / 4 - LUT_WORDS) / (WARPS * stage_words(a_rows));
    }
    static __host__ __device__ constexpr int smem_bytes(int a_rows) {
        return 4 * (LUT_WORDS + WARPS * stages_for(a_rows) * stage_words(a_rows));
    }
    static constexpr int STAGES = stages_for(TILE_M); // the fewest (a_rows = TILE_M)
    static_assert(STAGES >= 2 || SHARED_A_, "the ring needs at least 2 stages: shrink MT or WARPS");
    static_assert(cp_async_wait_groups_supported(MAX_STAGES - 1), "cp_async_wait_dyn covers 0..5 pending groups");
    static constexpr int RING_WORDS_MIN = WARPS * STAGES * stage_words(0);
    static constexpr int ACC_FLOATS = MT * MB * 4; // per lane
    static constexpr int RED_WORDS = (WARPS_K - 1) * WARPS_N * ACC_FLOATS * 32;
    static_assert(SHARED_A_ || RED_WORDS <= RING_WORDS_MIN, "the k-reduction buffer aliases the ring");
    static constexpr int TILE_FLOATS = WARPS_N * ACC_FLOATS * 32; // workspace slot per CTA tile
    static constexpr int MIN_CTAS_PER_SM = CTAS_PER_SM;            // caps registers (128 for 8-warp CTAs)
    static_assert(TILE_FLOATS == TILE_M * TILE_N, "a slot holds exactly one C tile");
};

// ---------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------
// cp.async 16 bytes, L2-only (weights are read once); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_16(uint32_t s_addr, const void* g_ptr) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s_addr), "l"(g_ptr));
}
// cp.async 16 bytes, reading src_bytes (0: zero fill); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_16_zfill(uint32_t s_addr, const void* g_ptr, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s_addr), "l"(g_ptr), "r"(src_bytes));
}
// cp.async 4 bytes, reading src_bytes (0: zero fill); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_4_zfill(uint32_t s_addr, const void* g_ptr, uint32_t src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s_addr), "l"(g_ptr), "r"(src_bytes));
}
// cp.async 8 bytes (.ca: .cg only takes 16); PTX ISA 9.7.9.25
__device__ __forceinline__ void cp_async_8(uint32_t s_addr, const void* g_ptr) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s_addr), "l"(g_ptr));
}
// close the current cp.async group; PTX ISA 9.7.9.26
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// wait until at most N cp.async groups of this thread are pending; PTX ISA 9.7.9.27
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// same with a run-time count (the ring depth is chosen at launch); the switch is warp-uniform
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
    switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    default: cp_async_wait<5>(); break;
    }
}
// Programmatic dependent launch (PTX griddepcontrol, sm_90; a no-op before sm_90 and in a plain launch)
// wait: until the grid this launch depends on has completed and its memory is visible to this one
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// the dependent launch may be scheduled once every CTA of this grid has run this (or exited)
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}
// a hint: fetch `bytes` (a multiple of 16, 16-byte aligned) into L2. No value reaches the SM, so it may run
// before grid_dependency_wait even on memory the previous grid writes; PTX ISA cp.async.bulk.prefetch
__device__ __forceinline__ void prefetch_l2_bulk(const void* g_ptr, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(g_ptr), "r"(bytes) : "memory");
#endif
}
// Thread-block clusters and mbarriers (sm_90 and later; compiled to nothing before, where no cluster is launched):
// PTX ISA 9.7.12.3 (barrier.cluster), 9.7.9.21 (mapa), 9.7.9.8 (ld.shared::cluster), 9.7.9.12 (st.async),
// 9.7.13.15 (mbarrier), 10.9 (%cluster_ctarank)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KBIT_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define KBIT_SM90_ASM(...) ((void)0)
#endif
__device__ __forceinline__ void cluster_barrier() {
    KBIT_SM90_ASM("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// the two halves of cluster_barrier, for work in between; arrive_relaxed orders nothing but the mbarrier init
// fence (fence.mbarrier_init) that precedes it
__device__ __forceinline__ void cluster_arrive_relaxed() {
    KBIT_SM90_ASM("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { KBIT_SM90_ASM("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
    KBIT_SM90_ASM("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// the address of shared-memory word s_addr of this CTA in the CTA of cluster rank `rank`
__device__ __forceinline__ uint32_t map_to_rank(uint32_t s_addr, uint32_t rank) {
    uint32_t d = 0;
    KBIT_SM90_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(d) : "r"(s_addr), "r"(rank));
    return d;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t s_cluster_addr) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    KBIT_SM90_ASM("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                  : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                  : "r"(s_cluster_addr)
                  : "memory");
    return v;
}
// 16 bytes into another CTA's shared memory, completing 16 bytes of the transaction count of its mbarrier
// s_cluster_bar (both addresses: map_to_rank)
__device__ __forceinline__ void st_async_f32x4(uint32_t s_cluster_addr, float a, float b, float c, float d,
                                               uint32_t s_cluster_bar) {
    KBIT_SM90_ASM("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                      s_cluster_addr),
                  "f"(a), "f"(b), "f"(c), "f"(d), "r"(s_cluster_bar)
                  : "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    KBIT_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// the inits of this thread visible to the cluster's other CTAs (before their first remote arrive or st.async)
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
    KBIT_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    KBIT_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// wait for phase `parity` of mbarrier bar, acquiring at cluster scope what other CTAs released into it
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}
// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulate, A and B of type T (the tag argument picks the
// overload; the two differ only in the PTX type); PTX ISA 9.7.14.5.8
#define KBIT_DEFINE_MMA_M16N8K16(T, PTX_TYPE)                                                                    \
    __device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, \
                                                 T) {                                                            \
        asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "  \
            "{%8,%9}, {%0,%1,%2,%3};\n"                                                                          \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                     \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                     \
    }
KBIT_DEFINE_MMA_M16N8K16(__half, "f16")
KBIT_DEFINE_MMA_M16N8K16(__nv_bfloat16, "bf16")
#undef KBIT_DEFINE_MMA_M16N8K16
// 32-bit shared load at a byte address; not volatile: the LUT is read-only after its barrier and the
// address depends on ring data, so the load cannot move above either; PTX ISA 9.7.9.8
__device__ __forceinline__ uint32_t lds32(uint32_t s_addr) {
    uint32_t v;
    asm("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(s_addr));
    return v;
}

// 64-bit shared load (a quad LUT entry), same ordering argument as lds32; PTX ISA 9.7.9.8
__device__ __forceinline__ uint2 lds64(uint32_t s_addr) {
    uint2 v;
    asm("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(s_addr));
    return v;
}

// atomic add with release (this thread's writes, and those ordered before it by a CTA barrier) and acquire
// semantics at GPU scope; returns the old value. PTX ISA 9.7.13.5 (atom), 8.10 (release/acquire patterns)
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* addr, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(addr), "r"(v) : "memory");
    return old;
}

// 16-byte shared store; PTX ISA 9.7.9.9
__device__ __forceinline__ void sts128(uint32_t s_addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(s_addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
// 8 consecutive 16-bit A values where A may be misaligned (lda % 8 != 0 or an offset view): eight
// 2-byte loads packed pairwise, the layout a 16-byte load would give
__device__ __forceinline__ uint4 ldg_a_unaligned(const unsigned short* src) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)__ldg(src + 2 * i) | ((uint32_t)__ldg(src + 2 * i + 1) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---------------------------------------------------------------------------------------------
// Small type helpers
// ---------------------------------------------------------------------------------------------
template <typename T> struct Pack2;
template <> struct Pack2<__half> {
    static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
        __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ float to_float(const __half v) { return __half2float(v); }
    static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
    static __device__ __forceinline__ uint32_t dup_lo(uint32_t a) { // {a.lo, a.lo}
        __half2 r = __low2half2(*reinterpret_cast<__half2*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ uint32_t dup_hi(uint32_t a) { // {a.hi, a.hi}
        __half2 r = __high2half2(*reinterpret_cast<__half2*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static constexpr int E4M4_SHIFT = 6;          // (code << 6) as fp16 == absmax / 16
    static constexpr float E4M4_LUT_FACTOR = 16.0f;
};
template <> struct Pack2<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
        __nv_bfloat162 r =
            __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ float to_float(const __nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
    static __device__ __forceinline__ uint32_t dup_lo(uint32_t a) {
        __nv_bfloat162 r = __low2bfloat162(*reinterpret_cast<__nv_bfloat162*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static __device__ __forceinline__ uint32_t dup_hi(uint32_t a) {
        __nv_bfloat162 r = __high2bfloat162(*reinterpret_cast<__nv_bfloat162*>(&a));
        return *reinterpret_cast<uint32_t*>(&r);
    }
    static constexpr int E4M4_SHIFT = 3;                    // (code << 3) as bf16 == absmax * 2^-116
    static constexpr float E4M4_LUT_FACTOR = 8.3076749736557242e34f; // 2^116
};

// decode LUT index e -> the two codebook indices (see TiledFormat)
template <int K_BITS> __host__ __device__ inline void lut_index_to_pair(int e, int& i0, int& i1) {
    using F = TiledFormat<K_BITS>;
    const int lo = e & ((1 << F::LO_FIELD_BITS) - 1);
    const int hi = e >> F::LO_FIELD_BITS;
    const int lo_mask = (1 << F::LO_BITS_PER_ELEM) - 1;
    i0 = (lo & lo_mask) | ((hi & 1) << F::LO_BITS_PER_ELEM);
    i1 = (lo >> F::LO_BITS_PER_ELEM) | (((hi >> 1) & 1) << F::LO_BITS_PER_ELEM);
}

// ---------------------------------------------------------------------------------------------
// Repack kernels: flat (checkpoint) format -> tiled. One thread per tiled word / absmax entry.
// ---------------------------------------------------------------------------------------------
// which element (row offset in unit, k offset in unit) and index bit a tiled bit holds
template <int K_BITS>
__host__ __device__ inline void tiled_bit_source(int lane, int lw, int bit, int& row, int& kk, int& ibit) {
    using F = TiledFormat<K_BITS>;
    const int pos = 32 * lw + bit; // in the lane's bit stream
    const int q = pos / F::FIELD_BITS, x = pos % F::FIELD_BITS;
    int elem;
    if (x < F::LO_FIELD_BITS) {
        elem = x / F::LO_BITS_PER_ELEM;
        ibit = x % F::LO_BITS_PER_ELEM;
    } else {
        elem = x - F::LO_FIELD_BITS;
        ibit = F::LO_BITS_PER_ELEM;
    }
    const int u = q / 4, j = q % 4;
    const int blk = u / 2, s = u % 2;
    const int half = j & 1, pair = 2 * s + (j >> 1);
    const int g = lane / 4, t = lane % 4;
    row = g + 8 * half;
    kk = blk * BLOCK_ELEMS + 8 * pair + 2 * t + elem;
}

template <int K_BITS>
__global__ void kbit_repack_words_kernel(const uint32_t* __restrict__ g_packed_flat, uint32_t* __restrict__ g_tiled,
                                         int N, int K_dim, int k_steps, long long total_words) {
    using F = TiledFormat<K_BITS>;
    const long long w = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (w >= total_words) return;
    const long long unit = w / F::UNIT_WORDS;
    const int off = (int)(w % F::UNIT_WORDS);
    // invert unit_word_offset
    int lane, lw;
    if (off < F::NV4 * 128) {
        lw = (off / 128) * 4 + (off % 4);
        lane = (off % 128) / 4;
    } else {
        const int o = off - F::NV4 * 128;
        lane = o / 2;
        lw = 4 * F::NV4 + o % 2;
    }
    const long long n16 = unit / k_steps;
    const int kstep = (int)(unit % k_steps);
    uint32_t word = 0;
    for (int bit = 0; bit < 32; bit++) {
        int row, kk, ibit;
        tiled_bit_source<K_BITS>(lane, lw, bit, row, kk, ibit);
        const long long n = n16 * UNIT_ROWS + row;
        const long long k = (long long)kstep * UNIT_K + kk;
        if (n >= N || k >= K_dim) continue;
        const long long flat = n * K_dim + k;
        const long long block = flat / BLOCK_ELEMS;
        const int j = (int)(flat % BLOCK_ELEMS);
        const uint32_t plane = g_packed_flat[block * K_BITS + ibit];
        word |= ((plane >> j) & 1u) << bit;
    }
    g_tiled[w] = word;
}

template <typename AbsT>
__global__ void kbit_repack_absmax_kernel(const AbsT* __restrict__ g_absmax_flat, AbsT* __restrict__ g_absmax_tiled,
                                          int N, int K_dim, int k_steps, long long total) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const long long unit = i / UNIT_ABSMAX;
    const int off = (int)(i % UNIT_ABSMAX); // [g 0..7][half 0..1][blk 0..3]
    const int g = off / 8, half = (off / 4) % 2, blk = off % 4;
    const long long n = (unit / k_steps) * UNIT_ROWS + g + 8 * half;
    const long long k = (unit % k_steps) * UNIT_K + blk * BLOCK_ELEMS;
    AbsT v;
    memset(&v, 0, sizeof(v));
    if (n < N && k < K_dim) v = g_absmax_flat[(n * K_dim + k) / BLOCK_ELEMS];
    g_absmax_tiled[i] = v;
}

// ---------------------------------------------------------------------------------------------
// Fused dequant + GEMM
// ---------------------------------------------------------------------------------------------
struct KbitGemmParams {
    const void* A;          // [M, lda] fp16/bf16
    const uint32_t* B;      // tiled words
    const void* B_absmax;   // tiled absmax (uint8 E4M4 or fp16)
    const float* codebook;  // [codebook_len]
    int codebook_len;
    const void* bias;       // [N] or nullptr
    void* C;                // [M, N]
    float* partials;        // workspace slots (k_splits > 1)
    int* counters;          // workspace tile counters (k_splits > 1)
    int M, N, K_dim, lda;
    int k_steps;            // K_pad / UNIT_K
    int n16_tiles;          // N_pad / UNIT_ROWS
    int k_splits, ks_per_split;
    int a_vec_ok;           // A 16-byte aligned and lda % 8 == 0
    int a_rows;             // token rows of A staged per k-step: min(M, TILE_M)
    int cluster_reduce;     // the k_splits CTAs of a tile are one cluster and reduce through DSMEM (config 6;
                            // shared-A: pairs of splits as 2-CTA clusters, push_split_k)
    int ws_tail_from;       // config 7 without k_splits: tiles from here on run as two CTAs of half the k-steps
    int ws_multicast;       // config 7: clusters of 2 CTAs share the token tile (TMA multicast)
    int l2_prefetch_steps;  // shared-A configs: k-steps of each warp's split prefetched into L2 before the PDL wait
};

// build the duplicated LUT: entry e (all copies) at byte e << LUT_STRIDE_LOG2, copy c at + c * LUT_ENTRY_BYTES.
// The codebook sits one entry per lane (read with shfl); each thread computes its entry once (2 shuffles, 4 for a
// quad) and writes 16 bytes (4 pair copies, or 2 quad copies) per store. The build is part of every call's fixed
// cost: built twice (KBIT_PROBE_LUT_TWICE), H100, M = 1, us, 14336 x 4096 / 8192 x 8192 k = 2 10.7 / 11.6 -> 11.5 /
// 12.7, k = 5 16.6 / 18.0 -> 18.1 / 19.5. Computing every 16-byte chunk's entry anew (4 quad shuffles per store, 32
// per thread at k = 2) took, against once per entry: k = 2, M = 1 / 16, 8192 x 8192 11.6 / 15.4 -> 10.8 / 15.2,
// 2048 x 4096 5.4 / 5.7 -> 5.1 / 5.6, 14336 x 4096 10.7 / 14.0 -> 10.5 / 13.7; k = 3..5 within 1% on geometric mean.
// The per-warp configs (0, 1) keep the chunk-wise build: with one entry per thread config 0 on 1024 x 4096 at k = 5
// ran 5.2-5.3 -> 5.5-5.7 us at M = 1 (H100 probe) and 5.4 -> 6.5 at M = 2 (benchmark), k = 2 M = 1 4.4 -> 4.4-4.8.
// The lane's codebook entry (0 past the end). The one-token-tile kernels and the wgmma kernel load it before
// their first weight loads (EARLY_CODEBOOK): issued after them it waited behind the prologue's DRAM reads
// (ncu, H100, 14336 x 4096 M = 1 k = 4: 21% of the warp-stall samples sat on its first use; H100, us, M = 1
// 14336 x 4096 k = 2 14.3 -> 13.5, 8192 x 8192 14.7 -> 14.0). Config 3 (M <= 16) keeps the late load:
// early, ptxas rematerialized a thread index in its loop and 28672 x 8192 M = 16 ran 9-14% slower.
// The load is predicated, and ptxas multiplies the entry by the LUT factor right after it, so each warp waits for
// the codebook before it issues A and its weights: the L2 prefetch of the first k-steps gets that head start. An
// unpredicated load (select and multiply in build_lut) issues them at once and was 5-10% slower (H100, M = 1, us:
// 4096 x 14336 k = 3 13.2 -> 14.0, 8192 x 8192 k = 4 16.0 -> 17.5; docs/kernel.md "The codebook wait"). Nothing in
// the source asks for that order: an unrelated epilogue change made ptxas sink the multiply below the weight loads in
// config 8 (4096 x 14336 M = 1 k = 4 13.9 -> 16.0 us). dev/check_codebook_order.py checks a build for it.
__device__ __forceinline__ float load_codebook_entry(const KbitGemmParams& p) {
    const int lane = threadIdx.x % 32;
#ifdef KBIT_PROBE_CODEBOOK_CONST // timing probe only: no codebook read (as if it came by value; wrong values)
    return lane < p.codebook_len ? 0.125f * (float)(lane - p.codebook_len / 2) : 0.0f;
#endif
    return lane < p.codebook_len ? __ldg(p.codebook + lane) : 0.0f;
}

// cb_entry: the lane's load_codebook_entry when EARLY_CODEBOOK, else unused (loaded here)
template <class Cfg, typename T, bool EARLY_CODEBOOK>
__device__ void build_lut(uint32_t* s_lut, float cb_entry, const KbitGemmParams& p) {
    const float factor = !Cfg::ABS_U8 ? 1.0f : Cfg::POST_SCALE || Cfg::BLOCK_COLUMNS ? 16.0f : Pack2<T>::E4M4_LUT_FACTOR;
    const float r_cb = (EARLY_CODEBOOK ? cb_entry : load_codebook_entry(p)) * factor;
    const auto pair_value = [&](int pair_index) { // {cb[i0], cb[i1]} * factor; every lane must call it
        int i0, i1;
        lut_index_to_pair<Cfg::K_BITS>(pair_index, i0, i1);
        return Pack2<T>::from_floats(__shfl_sync(0xffffffffu, r_cb, i0), __shfl_sync(0xffffffffu, r_cb, i1));
    };
    constexpr int CHUNKS_PER_ENTRY = Cfg::LUT_COPIES * Cfg::LUT_ENTRY_BYTES / 16;
    const auto entry_value = [&](int e) { // every lane must call it (pair_value shuffles)
        if constexpr (Cfg::QUAD_LUT) { // quad e = pair (e & 15) then pair (e >> 4): two MMA registers
            const uint32_t lo = pair_value(e & 15), hi = pair_value(e >> 4);
            return make_uint4(lo, hi, lo, hi);
        } else {
            const uint32_t pv = pair_value(e);
            return make_uint4(pv, pv, pv, pv);
        }
    };
#ifdef KBIT_PROBE_LUT_TWICE // timing probe only: the table built twice (the cost of one build)
    for (int rep = 0; rep < 2; rep++) {
        asm volatile("" ::: "memory");
#endif
    if constexpr (!Cfg::LUT_BUILD_BY_ENTRY) { // each 16-byte chunk computes its entry (per-warp configs, below)
        constexpr int CHUNKS = Cfg::LUT_WORDS / 4;
        static_assert(CHUNKS % 32 == 0 && Cfg::THREADS % 32 == 0, "a warp's lanes all run the last round or none");
#pragma unroll 4
        for (int x = threadIdx.x; x < CHUNKS; x += Cfg::THREADS) {
            const int e = x / CHUNKS_PER_ENTRY;
            const int c = (x + e) % CHUNKS_PER_ENTRY;
            reinterpret_cast<uint4*>(s_lut)[e * CHUNKS_PER_ENTRY + c] = entry_value(e);
        }
    } else {
        // TPE threads per entry (a power of 2: one round where the threads outnumber the entries) compute the
        // entry once and store CHUNKS_PER_ENTRY / TPE of its 16-byte chunks each, rotated so that the 8 lanes of a
        // store phase hit distinct 16-byte bank groups
        constexpr int ENTRIES = Cfg::LUT_ENTRIES;
        constexpr int THREADS_PER_ENTRY_MAX = Cfg::THREADS / ENTRIES; // 0 where the entries outnumber the threads
        constexpr int TPE =
            1 << ilog2(THREADS_PER_ENTRY_MAX < CHUNKS_PER_ENTRY ? THREADS_PER_ENTRY_MAX : CHUNKS_PER_ENTRY);
        constexpr int CHUNKS_PER_THREAD = CHUNKS_PER_ENTRY / TPE;
        constexpr int ROUNDS = (ENTRIES * TPE + Cfg::THREADS - 1) / Cfg::THREADS;
        constexpr int ENTRIES_PER_PHASE = CHUNKS_PER_ENTRY < 8 ? 8 / CHUNKS_PER_ENTRY : 1; // entries of a 128-B row
        static_assert(CHUNKS_PER_ENTRY % TPE == 0 && Cfg::THREADS % 32 == 0, "whole chunks per thread; whole warps");
#pragma unroll
        for (int r = 0; r < ROUNDS; r++) {
            const int idx = r * Cfg::THREADS + (int)threadIdx.x;
            const int e = idx / TPE, part = idx % TPE;
            const uint4 v = entry_value(e < ENTRIES ? e : 0); // every lane shuffles
            if (e < ENTRIES) {
#pragma unroll
                for (int j = 0; j < CHUNKS_PER_THREAD; j++) {
                    const int c = (part * CHUNKS_PER_THREAD + j + e / ENTRIES_PER_PHASE) % CHUNKS_PER_ENTRY;
                    reinterpret_cast<uint4*>(s_lut)[e * CHUNKS_PER_ENTRY + c] = v;
                }
            }
        }
    }
#ifdef KBIT_PROBE_LUT_TWICE
    }
#endif
}

// Per-lane global read positions of one warp's stream, advanced by one k-step per call (pointer
// increments only: recomputing unit indices per step cost ~40% of the loop's instructions, H200 SASS).
template <class Cfg> struct StreamCursor {
    const uint32_t* g_w[Cfg::MT];     // this lane's first uint4 chunk of unit (n16_base + mt, kstep)
    const char* g_abs[Cfg::MT];       // this lane's absmax bytes of that unit
    const unsigned short* g_a;        // A: row m_base + g, k = kstep * 128 + 8t (MB == 1 ring path)
    int k_a;                          // k of g_a (block 0), for the K_dim zero fill
    uint32_t valid_mt;                // bit mt: unit row exists (n16 < n16_tiles)
    bool a_row_ok;                    // A row exists (m < M and row < a_rows)

    __device__ __forceinline__ void init(const KbitGemmParams& p, int n16_base, int m_base, int kstep, int lane) {
        using F = typename Cfg::Fmt;
        valid_mt = 0;
#pragma unroll
        for (int mt = 0; mt < Cfg::MT; mt++) {
            const int n16 = n16_base + mt;
            valid_mt |= (n16 < p.n16_tiles ? 1u : 0u) << mt;
#ifdef KBIT_PROBE_UNIT_GROUP // timing probe only: the units of KBIT_PROBE_UNIT_GROUP rows side by side per k-step
            // (a permutation of the same bytes where n16_tiles is a multiple of the group; wrong values)
            constexpr int G = KBIT_PROBE_UNIT_GROUP;
            const int n16c = min(n16, p.n16_tiles - 1);
            const long long unit = ((long long)(n16c / G) * p.k_steps + kstep) * G + n16c % G;
#else
#ifdef KBIT_PROBE_L2_WEIGHTS // timing probe only: units mod KBIT_PROBE_L2_WEIGHTS, a weight slice the L2 holds
            const long long unit = (long long)(min(n16, p.n16_tiles - 1) % KBIT_PROBE_L2_WEIGHTS) * p.k_steps + kstep;
#else
            const long long unit = (long long)min(n16, p.n16_tiles - 1) * p.k_steps + kstep;
#endif
#endif
            g_w[mt] = p.B + unit * F::UNIT_WORDS + lane * 4;
            g_abs[mt] = reinterpret_cast<const char*>(p.B_absmax) +
                        (unit * UNIT_ABSMAX + (lane / 4) * 8) * (Cfg::ABS_U8 ? 1 : 2);
        }
        const int g = lane / 4, t = lane % 4;
        const int m = m_base + g;
        a_row_ok = g < p.a_rows && m < p.M;
        k_a = kstep * UNIT_K + 8 * t;
        g_a = reinterpret_cast<const unsigned short*>(p.A) + (long long)min(m, p.M - 1) * p.lda + k_a;
    }
    __device__ __forceinline__ void advance() {
#pragma unroll
        for (int mt = 0; mt < Cfg::MT; mt++) {
#ifdef KBIT_PROBE_UNIT_GROUP
            g_w[mt] += Cfg::Fmt::UNIT_WORDS * KBIT_PROBE_UNIT_GROUP;
            g_abs[mt] += UNIT_ABSMAX * (Cfg::ABS_U8 ? 1 : 2) * KBIT_PROBE_UNIT_GROUP;
#else
            g_w[mt] += Cfg::Fmt::UNIT_WORDS;
            g_abs[mt] += UNIT_ABSMAX * (Cfg::ABS_U8 ? 1 : 2);
#endif
        }
        g_a += UNIT_K;
        k_a += UNIT_K;
    }
};

// issue the cp.async copies of one k-step (MT units: weights + absmax) into ring stage s_stage
template <class Cfg>
__device__ __forceinline__ void load_stage_async(uint32_t s_stage, const StreamCursor<Cfg>& cur, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        if (!((cur.valid_mt >> mt) & 1)) continue; // warp-uniform; stale stage data only feeds unstored rows
        const uint32_t s_unit = s_stage + 4 * (mt * F::UNIT_WORDS + lane * 4);
#pragma unroll
        for (int c = 0; c < F::NV4; c++) cp_async_16(s_unit + 4 * c * 128, cur.g_w[mt] + c * 128);
        if (F::HAS_V2) // tail chunk: lane*2 instead of lane*4
            cp_async_8(s_unit + 4 * (F::NV4 * 128 - lane * 2), cur.g_w[mt] + F::NV4 * 128 - lane * 2);
        const uint32_t s_abs = s_stage + 4 * Cfg::STAGE_W_WORDS + (mt * 32 + lane) * Cfg::ABS_BYTES_PER_LANE;
        if (Cfg::ABS_U8) cp_async_8(s_abs, cur.g_abs[mt]);
        else cp_async_16(s_abs, cur.g_abs[mt]);
    }
}

// Per-warp A slot (configs 0, MB == 1): chunk c (k 8c..8c+7) of token row r of a block sits at chunk c ^ this, so
// the 8 rows of an ldmatrix phase (64 bytes apart) read distinct banks
__device__ __forceinline__ int a_chunk_swizzle(int row) { return (row >> 1) & 3; }

// A of one k-step into the stage (MB == 1): lane (g, t) copies chunk t (k 8t..8t+7) of each block of token row g;
// the warp reads them with ldmatrix after a __syncwarp (load_b_fragments). k >= K_dim is zero-filled (padded
// weights are 0 and 0 * garbage could be NaN); rows >= M are skipped: they only feed unstored columns.
template <class Cfg>
__device__ __forceinline__ void load_a_async(uint32_t s_a, const StreamCursor<Cfg>& cur, const KbitGemmParams& p,
                                             int lane) {
    static_assert(Cfg::MB == 1, "the ring holds A only for one token tile");
    if (!cur.a_row_ok) return;
    const int g = lane / 4, t = lane % 4;
    const uint32_t s_row = s_a + (g * 4 + (t ^ a_chunk_swizzle(g))) * 16;
    if (p.a_vec_ok && cur.k_a + (UNIT_K - 8 * t) <= p.K_dim) { // whole k-step inside K_dim (all but maybe the last)
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++) cp_async_16(s_row + blk * p.a_rows * 64, cur.g_a + blk * BLOCK_ELEMS);
        return;
    }
#pragma unroll
    for (int blk = 0; blk < UNIT_BLOCKS; blk++) {
        const uint32_t s_dst = s_row + blk * p.a_rows * 64;
        const bool in_k = cur.k_a + blk * BLOCK_ELEMS < p.K_dim;
        const unsigned short* src = in_k ? cur.g_a + blk * BLOCK_ELEMS : cur.g_a;
        if (p.a_vec_ok) {
            cp_async_16_zfill(s_dst, src, in_k ? 16u : 0u);
        } else { // A misaligned: 16-bit loads, then a plain store (ordered for the warp by the same __syncwarp)
            sts128(s_dst, in_k ? ldg_a_unaligned(src) : make_uint4(0, 0, 0, 0));
        }
    }
}

// 4 x 4 transpose of 32-bit words among the lanes of a quad: lane t's a[j] becomes lane j's a[t]. Two shuffle rounds,
// each swapping the 2 x 2 blocks (xor 2) or the words inside them (xor 1) that differ from the lane in that bit.
__device__ __forceinline__ void quad_transpose_words(uint32_t (&a)[4], int t) {
#pragma unroll
    for (int m = 2; m >= 1; m /= 2) {
        const bool hi = t & m;
        const int i0 = 0, i1 = m == 2 ? 1 : 2; // the two words whose index has bit m clear
        const uint32_t r0 = __shfl_xor_sync(0xffffffffu, hi ? a[i0] : a[i0 + m], m);
        const uint32_t r1 = __shfl_xor_sync(0xffffffffu, hi ? a[i1] : a[i1 + m], m);
        if (hi) a[i0] = r0, a[i1] = r1;
        else a[i0 + m] = r0, a[i1 + m] = r1;
    }
}
__device__ __forceinline__ void quad_transpose_words(uint4& v, int t) {
    uint32_t a[4] = {v.x, v.y, v.z, v.w};
    quad_transpose_words(a, t);
    v = make_uint4(a[0], a[1], a[2], a[3]);
}

// A_IN_RING == false: A of one k-step straight into registers (L1 shared by the warps): 16-byte chunk t (k 8t..8t+7)
// of each block of token g; quad_transpose_words then makes them the B fragments (words at k 8j + 2t, j = 0..3), as
// ldmatrix_b_frags would give them. H100, us, against four 4-byte loads per block (M = 16, k = 2 / 4): 1024 x 4096
// 6.9 / 7.1 -> 6.5 / 6.8, 2048 x 4096 9.2 / 9.7 -> 8.2 / 8.9; the same through a per-warp shared buffer and ldmatrix
// was as fast (6.4 / 6.8, 8.1 / 8.9) for 32 KB of shared memory. The permuted layout before (one 16-byte load, used as
// it came) took 6.3 / 6.5 and 7.8 / 8.4: these small weights at 5-16 tokens lost 3-6% with it.
template <class Cfg>
__device__ __forceinline__ void load_a_registers(uint4 (&r_a)[UNIT_BLOCKS][Cfg::MB], const KbitGemmParams& p,
                                                 int m_base, int kstep, int lane) {
    const int g = lane / 4, t = lane % 4;
    const unsigned short* g_A = reinterpret_cast<const unsigned short*>(p.A);
#pragma unroll
    for (int mb = 0; mb < Cfg::MB; mb++) {
        const int m = m_base + mb * 8 + g;
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++) {
            const int k = kstep * UNIT_K + blk * BLOCK_ELEMS;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (m < p.M && k < p.K_dim) {
                const unsigned short* src = g_A + (long long)m * p.lda + k + 8 * t;
                v = p.a_vec_ok ? __ldg(reinterpret_cast<const uint4*>(src)) : ldg_a_unaligned(src);
            }
            r_a[blk][mb] = v;
        }
    }
}

// The B fragments of one block for 8 tokens: the four 8 x 8 matrices (tokens x k 8j..8j+7, j = 0..3) whose row
// addresses lanes 8j..8j+7 give. Lane (g, t) gets token g, k 8j + 2t, +1 in register j: b0, b1 of k16 step 0, then
// of step 1 (section 3). PTX ISA 9.7.14.5.15 (ldmatrix)
__device__ __forceinline__ void ldmatrix_b_frags(uint4& r, uint32_t s_row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "r"(s_row_addr));
}

// 128-bit shared load of ring data (A), ordered like ldmatrix_b_frags (volatile: the ring is rewritten between
// barriers); PTX ISA 9.7.9.8
__device__ __forceinline__ uint4 lds128_ring(uint32_t s_addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(s_addr));
    return v;
}

// B-operand (activation) fragments of one block from the stage: b0,b1 of k16 step 0 = .x,.y, step 1 = .z,.w
template <class Cfg>
__device__ __forceinline__ void load_b_fragments(uint4 (&r_a)[Cfg::MB], uint32_t s_a, int a_rows, int blk, int lane) {
    const int chunk = lane / 8;
#pragma unroll
    for (int mb = 0; mb < Cfg::MB; mb++) {
        // rows >= a_rows only feed unstored columns: read a valid row instead of out of range
        const int row = min(mb * 8 + lane % 8, a_rows - 1);
        ldmatrix_b_frags(r_a[mb], s_a + ((blk * a_rows + row) * 4 + (chunk ^ a_chunk_swizzle(row))) * 16);
    }
}

template <class Cfg> __device__ __forceinline__ void zero_acc(float (&acc)[Cfg::MT][Cfg::MB][4]) {
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
        for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[mt][mb][r] = 0.0f;
}

// this lane's 2*K_BITS words of the unit at s_unit (lane-major 16-byte chunks, then 8-byte ones, as in global)
template <class Cfg>
__device__ __forceinline__ void lds_unit_words(uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS], uint32_t s_unit, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int c = 0; c < F::NV4; c++)
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r_w[4 * c]), "=r"(r_w[4 * c + 1]), "=r"(r_w[4 * c + 2]), "=r"(r_w[4 * c + 3])
                     : "r"(s_unit + 4 * (c * 128 + lane * 4)));
    if constexpr (F::HAS_V2)
        asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n"
                     : "=r"(r_w[4 * F::NV4]), "=r"(r_w[4 * F::NV4 + 1])
                     : "r"(s_unit + 4 * (F::NV4 * 128 + lane * 2)));
}

// ... and back (kbit_gemm_wgmma_ws.cuh: the weight transpose in shared memory)
template <class Cfg>
__device__ __forceinline__ void sts_unit_words(const uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS], uint32_t s_unit, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int c = 0; c < F::NV4; c++)
        sts128(s_unit + 4 * (c * 128 + lane * 4), make_uint4(r_w[4 * c], r_w[4 * c + 1], r_w[4 * c + 2], r_w[4 * c + 3]));
    if constexpr (F::HAS_V2)
        asm volatile("st.shared.v2.b32 [%0], {%1,%2};\n" ::"r"(s_unit + 4 * (F::NV4 * 128 + lane * 2)), "r"(r_w[4 * F::NV4]),
                     "r"(r_w[4 * F::NV4 + 1]));
}

// this lane's absmax of rows g, g + 8 (8 bytes of E4M4 or 16 of fp16) at s_abs
template <class Cfg>
__device__ __forceinline__ void lds_unit_absmax(uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], uint32_t s_abs) {
    if constexpr (Cfg::ABS_U8)
        asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(r_abs[0]), "=r"(r_abs[1]) : "r"(s_abs));
    else
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r_abs[0]), "=r"(r_abs[1]), "=r"(r_abs[2]), "=r"(r_abs[3])
                     : "r"(s_abs));
}

// this lane's 2*K_BITS words and absmax bytes of unit mt of a ring stage (the layout load_stage_async wrote)
template <class Cfg>
__device__ __forceinline__ void read_unit_from_stage(uint32_t (&r_w)[Cfg::Fmt::LANE_WORDS],
                                                     uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], uint32_t s_stage,
                                                     int mt, int lane) {
    lds_unit_words<Cfg>(r_w, s_stage + 4 * mt * Cfg::Fmt::UNIT_WORDS, lane);
    lds_unit_absmax<Cfg>(r_abs, s_stage + 4 * Cfg::STAGE_W_WORDS + (mt * 32 + lane) * Cfg::ABS_BYTES_PER_LANE);
}

// scale pair {s, s} for (half, blk) of one unit, as the compute dtype; the E4M4 factor is in the LUT.
// E4M4: the 4 codes of a row half sit in one word (byte b = block b); a rotation by E4M4_SHIFT and one mask turn it
// into the half2 {s0, s2} (bytes 0, 2 at bits SH.. and 16 + SH..), a rotation the other way into {s1, s3}, and
// each scale is the low or high half of one of them, broadcast (a .H0_H0 / .H1_H1 operand of the HMUL2, no
// instruction). The rotations are shared by the 4 blocks: 4 instructions per row half instead of a PRMT (dup) and
// a shift per block.
template <class Cfg, typename T>
__device__ __forceinline__ uint32_t scale_pair(const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], int idx) {
    if constexpr (Cfg::ABS_U8) {
        constexpr int SH = Pack2<T>::E4M4_SHIFT;
        constexpr uint32_t MASK = (0xFFu << SH) * 0x10001u;
        const uint32_t word = r_abs[idx / 4];
        const int b = idx % 4;
        const uint32_t pairs = b % 2 == 0 ? __funnelshift_l(word, word, SH) & MASK   // {s0, s2}
                                          : __funnelshift_r(word, word, 8 - SH) & MASK; // {s1, s3}
        return b < 2 ? Pack2<T>::dup_lo(pairs) : Pack2<T>::dup_hi(pairs);
    } else {
        const uint32_t word = r_abs[idx / 2];
        if constexpr (sizeof(T) == 2 && std::is_same<T, __half>::value) {
            return __byte_perm(word, 0u, (idx % 2) ? 0x3232u : 0x1010u);
        } else {
            const uint32_t hbits = (idx % 2) ? (word >> 16) : (word & 0xffffu);
            const float f = __half2float(__ushort_as_half((unsigned short)hbits));
            return Pack2<T>::from_floats(f, f);
        }
    }
}

// LUT byte address of pair q of a lane (q compile-time after unrolling): one shift (a funnel shift where the
// field straddles two words) moves field bit 0 to bit LS, one LOP3 masks it and adds the lane's copy
template <class Cfg, int Q> __device__ __forceinline__ uint32_t lut_addr(const uint32_t* r_w, uint32_t lane_off) {
    using F = typename Cfg::Fmt;
    constexpr int LS = Cfg::LUT_STRIDE_LOG2;
    constexpr int POS = Q * F::FIELD_BITS;
    constexpr int W = POS / 32, B = POS % 32; // field bit 0 = bit B of word W
    constexpr uint32_t MASK = ((1u << F::FIELD_BITS) - 1) << LS;
    uint32_t x;
    if constexpr (B + F::FIELD_BITS > 32) { // straddles: B > 32 - FIELD_BITS >= 22 > LS
        static_assert(B >= LS, "a straddling field shifts right");
        x = __funnelshift_r(r_w[W], r_w[W + 1], B - LS);
    } else {
        x = B >= LS ? r_w[W] >> (B >= LS ? B - LS : 0) : r_w[W] << (B < LS ? LS - B : 0);
    }
    return (x & MASK) | lane_off;
}

// the block scale of (half, blk) as an fp32 (POST_SCALE): E4M4 = the code's bits << 19 (absmax * 2^-116,
// OUT_FACTOR restores it at the store); fp16 absmax converted exactly
template <class Cfg>
__device__ __forceinline__ float scale_f32(const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], int idx) {
    if constexpr (Cfg::ABS_U8) {
        const uint32_t word = r_abs[idx / 4];
        const int sh = 19 - 8 * (idx % 4);
        return __uint_as_float((sh >= 0 ? word << sh : word >> -sh) & (0xFFu << 19));
    } else {
        const uint32_t word = r_abs[idx / 2];
        return __half2float(__ushort_as_half((unsigned short)((idx % 2) ? word >> 16 : word & 0xffffu)));
    }
}

// quad LUT byte address of quad R = 2u + h of a lane (k = 2: pairs 4u + 2h, + 1): byte R % 4 of lo word R / 4
template <class Cfg, int R> __device__ __forceinline__ uint32_t quad_lut_addr(const uint32_t* r_w, uint32_t lane_off) {
    constexpr int LS = Cfg::LUT_STRIDE_LOG2;
#ifdef KBIT_PROBE_QUAD_ONE_OP // timing probe only: one LOP3 per quad address, no shift (wrong values; a distinct
                              // in-table address per quad, so nothing folds): what a one-instruction address saves
    return (r_w[R / 4] & ((0xFFu << LS) & ~((uint32_t)(R % 4) << LS))) | lane_off;
#else
    constexpr int SH = 8 * (R % 4) - LS;
    const uint32_t w = r_w[R / 4];
    return ((SH >= 0 ? w >> (SH >= 0 ? SH : 0) : w << (SH < 0 ? -SH : 0)) & (0xFFu << LS)) | lane_off;
#endif
}

// the unscaled A-operand fragment (codebook values, times the LUT factor) of MMA u = 2*blk + s of a unit
template <class Cfg, int U>
__device__ __forceinline__ void lookup_frag_a(uint32_t (&frag_a)[4], const uint32_t* r_w, uint32_t s_lut,
                                              uint32_t lane_off) {
    if constexpr (Cfg::QUAD_LUT) { // quad 2U + h = registers 2h, 2h + 1: consecutive, no moves for the MMA
#ifdef KBIT_PROBE_NO_TABLE // timing probe only: the table addresses as the fragment (no LDS, wrong values)
        const uint32_t x0 = quad_lut_addr<Cfg, 2 * U>(r_w, lane_off), x1 = quad_lut_addr<Cfg, 2 * U + 1>(r_w, lane_off);
        const uint2 q0 = make_uint2(x0, x0 ^ 0x3c003c00u), q1 = make_uint2(x1, x1 ^ 0x3c003c00u);
        (void)s_lut;
#else
        const uint2 q0 = lds64(s_lut + quad_lut_addr<Cfg, 2 * U>(r_w, lane_off));
        const uint2 q1 = lds64(s_lut + quad_lut_addr<Cfg, 2 * U + 1>(r_w, lane_off));
#endif
        frag_a[0] = q0.x;
        frag_a[1] = q0.y;
        frag_a[2] = q1.x;
        frag_a[3] = q1.y;
    } else {
        frag_a[0] = lds32(s_lut + lut_addr<Cfg, 4 * U + 0>(r_w, lane_off));
        frag_a[1] = lds32(s_lut + lut_addr<Cfg, 4 * U + 1>(r_w, lane_off));
        frag_a[2] = lds32(s_lut + lut_addr<Cfg, 4 * U + 2>(r_w, lane_off));
        frag_a[3] = lds32(s_lut + lut_addr<Cfg, 4 * U + 3>(r_w, lane_off));
    }
}

// the scaled A-operand fragments of quantization block BLK (MMAs u = 2 BLK, 2 BLK + 1) of one unit
template <class Cfg, typename T, int BLK>
__device__ __forceinline__ void dequant_block(uint32_t (&frag0)[4], uint32_t (&frag1)[4], const uint32_t* r_w,
                                              const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4], uint32_t s_lut,
                                              uint32_t lane_off) {
    lookup_frag_a<Cfg, 2 * BLK>(frag0, r_w, s_lut, lane_off);
    lookup_frag_a<Cfg, 2 * BLK + 1>(frag1, r_w, s_lut, lane_off);
#ifdef KBIT_PROBE_NO_SCALE // timing probe only: the fragments stay unscaled (wrong values): the scales' cost
    (void)r_abs;
#else
    const uint32_t sc_g = scale_pair<Cfg, T>(r_abs, BLK), sc_g8 = scale_pair<Cfg, T>(r_abs, 4 + BLK);
#pragma unroll
    for (int j = 0; j < 4; j++) { // register j: row g (j even) or g + 8 (j odd)
        frag0[j] = Pack2<T>::mul(frag0[j], (j & 1) ? sc_g8 : sc_g);
        frag1[j] = Pack2<T>::mul(frag1[j], (j & 1) ? sc_g8 : sc_g);
    }
#endif
}

// dequant + MMAs of quantization block BLK (MMAs u = 2 BLK, 2 BLK + 1) of one unit, for MB token tiles
// whose B fragments are r_b[mb] (.x, .y: k16 step 0; .z, .w: step 1)
template <class Cfg, typename T, int BLK>
__device__ __forceinline__ void block_mma(float (&acc)[Cfg::MB][4], const uint32_t* r_w,
                                          const uint32_t (&r_abs)[Cfg::ABS_BYTES_PER_LANE / 4],
                                          const uint4 (&r_b)[Cfg::MB], uint32_t s_lut, uint32_t lane_off) {
    uint32_t frag0[4], frag1[4];
    if constexpr (Cfg::POST_SCALE) {
        lookup_frag_a<Cfg, 2 * BLK>(frag0, r_w, s_lut, lane_off);
        lookup_frag_a<Cfg, 2 * BLK + 1>(frag1, r_w, s_lut, lane_off);
        const float s_g = scale_f32<Cfg>(r_abs, BLK), s_g8 = scale_f32<Cfg>(r_abs, 4 + BLK);
#pragma unroll
        for (int mb = 0; mb < Cfg::MB; mb++) {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_m16n8k16(d, frag0, r_b[mb].x, r_b[mb].y, T());
            mma_m16n8k16(d, frag1, r_b[mb].z, r_b[mb].w, T());
            acc[mb][0] = fmaf(s_g, d[0], acc[mb][0]); // d0, d1: row g; d2, d3: row g + 8
            acc[mb][1] = fmaf(s_g, d[1], acc[mb][1]);
            acc[mb][2] = fmaf(s_g8, d[2], acc[mb][2]);
            acc[mb][3] = fmaf(s_g8, d[3], acc[mb][3]);
        }
    } else {
        dequant_block<Cfg, T, BLK>(frag0, frag1, r_w, r_abs, s_lut, lane_off);
#pragma unroll
        for (int mb = 0; mb < Cfg::MB; mb++) {
#ifdef KBIT_PROBE_F16_ACC // timing probe only: fp16 accumulators in acc[mb][0..1], never flushed (wrong values)
            uint32_t* h = reinterpret_cast<uint32_t*>(acc[mb]);
            asm("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
                : "+r"(h[0]), "+r"(h[1]) : "r"(frag0[0]), "r"(frag0[1]), "r"(frag0[2]), "r"(frag0[3]), "r"(r_b[mb].x), "r"(r_b[mb].y));
            asm("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
                : "+r"(h[0]), "+r"(h[1]) : "r"(frag1[0]), "r"(frag1[1]), "r"(frag1[2]), "r"(frag1[3]), "r"(r_b[mb].z), "r"(r_b[mb].w));
#else
            mma_m16n8k16(acc[mb], frag0, r_b[mb].x, r_b[mb].y, T());
            mma_m16n8k16(acc[mb], frag1, r_b[mb].z, r_b[mb].w, T());
#endif
        }
    }
}

// dequant + MMA of one k-step held in ring stage s_stage
template <class Cfg, typename T>
__device__ __forceinline__ void compute_stage(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t s_stage, uint32_t s_lut,
                                              uint32_t lane_off, int a_rows, const uint4 (&r_a_regs)[UNIT_BLOCKS][Cfg::MB],
                                              int lane) {
    using F = typename Cfg::Fmt;
    uint4 r_a[UNIT_BLOCKS][Cfg::MB];
    if constexpr (Cfg::A_IN_RING) {
        const uint32_t s_a = s_stage + 4 * (Cfg::STAGE_W_WORDS + Cfg::STAGE_ABS_WORDS);
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++) load_b_fragments<Cfg>(r_a[blk], s_a, a_rows, blk, lane);
    } else {
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++)
#pragma unroll
            for (int mb = 0; mb < Cfg::MB; mb++) r_a[blk][mb] = r_a_regs[blk][mb];
    }
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        uint32_t r_w[F::LANE_WORDS];
        uint32_t r_abs[Cfg::ABS_BYTES_PER_LANE / 4];
        read_unit_from_stage<Cfg>(r_w, r_abs, s_stage, mt, lane);
        block_mma<Cfg, T, 0>(acc[mt], r_w, r_abs, r_a[0], s_lut, lane_off);
        block_mma<Cfg, T, 1>(acc[mt], r_w, r_abs, r_a[1], s_lut, lane_off);
        block_mma<Cfg, T, 2>(acc[mt], r_w, r_abs, r_a[2], s_lut, lane_off);
        block_mma<Cfg, T, 3>(acc[mt], r_w, r_abs, r_a[3], s_lut, lane_off);
    }
}

// store the CTA tile (acc of warp wn after the k-reduction) to C, + bias
template <class Cfg, typename T>
__device__ __forceinline__ void store_output(const float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                             int n_base_warp, int m_base, int lane) {
    const int g = lane / 4, t = lane % 4;
    T* g_C = reinterpret_cast<T*>(p.C);
    const T* g_bias = reinterpret_cast<const T*>(p.bias);
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int n = n_base_warp + mt * UNIT_ROWS + g + 8 * (r / 2);
            if (n >= p.N) continue;
            const float b = g_bias ? Pack2<T>::to_float(g_bias[n]) : 0.0f;
#pragma unroll
            for (int mb = 0; mb < Cfg::MB; mb++) {
                const int m = m_base + mb * 8 + 2 * t + (r % 2);
                if (m < p.M) g_C[(long long)m * p.N + n] = Pack2<T>::from_float(acc[mt][mb][r] * Cfg::OUT_FACTOR + b);
            }
        }
    }
}

// One token (BLOCK_COLUMNS, after fold_block_columns): the live sums of row group g (unit mt, rows g and g + 8:
// acc[mt][0][0] and [2]) sit in every lane of quad g. With ONE_TOKEN_COMPACT_SLOT_MIN_SPLITS splits or more, lane t of
// the quad carries value t (unit t / 2, rows g + 8 (t % 2)) through the split-K slots: a CTA's slot is one float per
// lane instead of the whole fragment (8), and the last CTA loads one float per lane and split instead of 8. H100, us,
// M = 1, k = 2 / 3 / 4, fragment -> one float: 2048 x 14336 (14 splits) 7.5 / 8.6 / 9.1 -> 6.8 / 8.0 / 8.4, 5120 x
// 13824 (6) 10.9 / 14.2 / 15.5 -> 10.6-10.9 / 14.0 / 15.2, 4096 x 14336 (8) 9.4 / 11.9 / 13.0 -> 9.3 / 11.8 / 12.9;
// with 4 splits as fast or slower (14336 x 4096, config 10, k = 3 / 4: 12.2 / 12.9 -> 12.6 / 13.2; cause not found).
// MT = 2 (configs 2, 8, 10, 12).
#ifndef ONE_TOKEN_COMPACT_SLOT_MIN_SPLITS
#define ONE_TOKEN_COMPACT_SLOT_MIN_SPLITS 6
#endif
template <class Cfg> __device__ __forceinline__ float one_token_slot_value(const float (&acc)[Cfg::MT][Cfg::MB][4], int lane) {
    static_assert(Cfg::MT == 2 && Cfg::MB == 1, "four live values per quad");
    const int t = lane % 4;
    const float u0 = t % 2 ? acc[0][0][2] : acc[0][0][0], u1 = t % 2 ? acc[1][0][2] : acc[1][0][0];
    return t / 2 ? u1 : u0;
}
// the inverse: every lane of quad g gets its quad's four values back where store_output reads them
template <class Cfg> __device__ __forceinline__ void one_token_slot_unpack(float (&acc)[Cfg::MT][Cfg::MB][4], float v, int lane) {
    const int quad = lane & ~3;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        acc[mt][0][0] = __shfl_sync(0xffffffffu, v, quad + 2 * mt);
        acc[mt][0][2] = __shfl_sync(0xffffffffu, v, quad + 2 * mt + 1);
        acc[mt][0][1] = acc[mt][0][3] = 0.0f;
    }
}

// split-K across CTAs: write this split's slot; the last CTA of the tile sums all slots in order.
// `sync`: a barrier over every thread that calls this (__syncthreads; config 7: its consumer warps)
struct CtaSync {
    __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
// (split, n_splits: blockIdx.y and p.k_splits unless the caller names others: config 7's split last wave)
template <class Cfg, class Sync = CtaSync>
__device__ __forceinline__ bool reduce_split_k(float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                               int tile_id, int wn, bool is_writer, int lane, int* s_flag,
                                               Sync sync = Sync(), int split = -1, int n_splits = 0, int reader = 0,
                                               int readers = 1) {
    constexpr int F = Cfg::ACC_FLOATS;
    if (split < 0) split = blockIdx.y, n_splits = p.k_splits;
    const long long slot_base = (long long)tile_id * n_splits * Cfg::TILE_FLOATS;
    const bool compact = Cfg::BLOCK_COLUMNS && n_splits >= ONE_TOKEN_COMPACT_SLOT_MIN_SPLITS; // one float per lane
    if (is_writer) {
        float* g_slot = p.partials + slot_base + (long long)split * Cfg::TILE_FLOATS + wn * F * 32;
        bool stored = false;
        if constexpr (Cfg::BLOCK_COLUMNS) {
            if (compact) __stcg(g_slot + lane, one_token_slot_value<Cfg>(acc, lane)), stored = true;
        }
        if (!stored) {
#pragma unroll
            for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                    for (int r = 0; r < 4; r++)
                        __stcg(g_slot + ((mt * Cfg::MB + mb) * 4 + r) * 32 + lane, acc[mt][mb][r]);
        }
    }
#ifdef KBIT_PROBE_SPLITK_STORE_ONLY // timing probe only: slot stores, no barrier, counter or reads; split 0 stores C
    return split == 0;
#endif
    sync(); // the CTA's slot stores happen before thread 0's release below
    if (threadIdx.x == 0) {
#ifdef KBIT_PROBE_SPLITK_RELAXED_ATOMIC // timing probe only: no fence around the counter (unordered slot reads)
        const int prev = atomicAdd(p.counters + tile_id, 1);
#else
        const int prev = atomic_add_acq_rel_gpu(p.counters + tile_id, 1); // release our slot, acquire the others'
#endif
        const int last = prev == n_splits - 1;
        if (last) p.counters[tile_id] = 0; // self-reset for the next call (kernel boundaries order it)
        *s_flag = last;
    }
    sync(); // thread 0's acquire happens before every thread's slot reads
    if (!*s_flag) return false;
#ifdef KBIT_PROBE_SPLITK_NO_READS // timing probe only: the last CTA stores its own partial as C
    return true;
#endif
    if (readers > 1 || is_writer) {
        // readers > 1: the warps along k of a row split the slots, reader r the r-th contiguous share, to be summed
        // in reader order by the caller (reduce_warps_k): each warp's loads then leave in one batch
        const int share = (n_splits + readers - 1) / readers;
        const int sp_end = min(n_splits, (reader + 1) * share);
        if constexpr (Cfg::BLOCK_COLUMNS) {
            if (compact) { // one float per lane and split, every split's load issued at once
                constexpr int MAX_SPLITS_LOADED = 16; // the dispatcher's MAX_SPLITS
                const float* g_slot = p.partials + slot_base + wn * F * 32 + lane;
                float v = 0.0f;
#pragma unroll
                for (int sp = 0; sp < MAX_SPLITS_LOADED; sp++)
                    if (sp < n_splits) v += __ldcg(g_slot + (long long)sp * Cfg::TILE_FLOATS);
                one_token_slot_unpack<Cfg>(acc, v, lane);
                return true;
            }
        }
        zero_acc<Cfg>(acc);
        for (int sp = reader * share; sp < sp_end; sp++) { // ptxas unrolls by 4 and issues 4 slots' loads together
            const float* g_slot = p.partials + slot_base + (long long)sp * Cfg::TILE_FLOATS + wn * F * 32;
#pragma unroll
            for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                    for (int r = 0; r < 4; r++)
                        acc[mt][mb][r] += __ldcg(g_slot + ((mt * Cfg::MB + mb) * 4 + r) * 32 + lane);
        }
    }
    return true;
}

// k-reduction across the WARPS_K warps of a CTA into warp wk = 0, in wk order. s_red: [WARPS_K-1][WARPS_N]
// [ACC_FLOATS][32] floats of shared memory that no thread reads or writes any more (the caller's barrier)
template <class Cfg>
__device__ __forceinline__ void reduce_warps_k(float (&acc)[Cfg::MT][Cfg::MB][4], float* s_red, int wn, int wk,
                                               int lane) {
    if constexpr (Cfg::WARPS_K > 1) {
        if (wk > 0) {
            float* dst = s_red + ((wk - 1) * Cfg::WARPS_N + wn) * Cfg::ACC_FLOATS * 32;
#pragma unroll
            for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                    for (int r = 0; r < 4; r++) dst[((mt * Cfg::MB + mb) * 4 + r) * 32 + lane] = acc[mt][mb][r];
        }
        __syncthreads();
        if (wk == 0) {
            for (int w = 1; w < Cfg::WARPS_K; w++) {
                const float* src = s_red + ((w - 1) * Cfg::WARPS_N + wn) * Cfg::ACC_FLOATS * 32;
#pragma unroll
                for (int mt = 0; mt < Cfg::MT; mt++)
#pragma unroll
                    for (int mb = 0; mb < Cfg::MB; mb++)
#pragma unroll
                        for (int r = 0; r < 4; r++) acc[mt][mb][r] += src[((mt * Cfg::MB + mb) * 4 + r) * 32 + lane];
            }
        }
    }
}

// Split-K of a shared-A tile in 2-CTA clusters (p.cluster_reduce; launch_shared_a in kbit_gemm.cu, an even number
// of splits): the odd split's writer warps (wk = 0, after the k-warp sum) store their partial into the even split's
// receive slot (s_recv: [WARPS_N][ACC_FLOATS / 4][32] float4) with st.async, which completes bytes on the even
// split's mbarrier s_bar, and the odd CTA leaves (false). The even split's writer warps wait for the tile's bytes
// and add the slot to their own partial (split 2j + split 2j + 1; with 2 splits the order and bits of the workspace
// path); the caller then reduces the pairs' sums through the workspace where there are more than 2 splits. Every
// thread of both CTAs calls it: its cluster_wait pairs with the cluster_arrive_relaxed after the even split
// initialised s_bar (kernel start).
template <class Cfg>
__device__ __forceinline__ bool push_split_k(float (&acc)[Cfg::MT][Cfg::MB][4], uint32_t s_recv, uint32_t s_bar,
                                             int wn, bool is_writer, int lane) {
    constexpr int F = Cfg::ACC_FLOATS;
    static_assert(F % 4 == 0, "the slot moves float4");
    float* a = &acc[0][0][0];
    const uint32_t slot = s_recv + 16u * (uint32_t)(wn * (F / 4) * 32 + lane);
    cluster_wait();
    if (blockIdx.y % 2 != 0) {
        if (is_writer) {
            const uint32_t dst = map_to_rank(slot, 0), bar = map_to_rank(s_bar, 0);
#pragma unroll
            for (int q = 0; q < F / 4; q++)
                st_async_f32x4(dst + 16u * 32u * (uint32_t)q, a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3], bar);
        }
        return false;
    }
    if (!is_writer) return true;
    if (threadIdx.x == 0) mbar_arrive_expect_tx(s_bar, (uint32_t)Cfg::TILE_FLOATS * 4u);
    mbar_wait_cluster(s_bar, 0);
#pragma unroll
    for (int q = 0; q < F / 4; q++) {
        float4 v;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                     : "r"(slot + 16u * 32u * (uint32_t)q)
                     : "memory");
        a[4 * q] += v.x, a[4 * q + 1] += v.y, a[4 * q + 2] += v.z, a[4 * q + 3] += v.w;
    }
    return true;
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS_PER_SM) kbit_gemm_kernel(const KbitGemmParams p) {
    extern __shared__ __align__(16) uint32_t s_mem[];
    grid_dependency_wait(); // PDL (kbit_gemm.cu): every read and write of this grid comes after the previous kernel
    const float cb_entry = Cfg::MB == 1 ? load_codebook_entry(p) : 0.0f; // first: overlaps the prologue
    __shared__ int s_flag;
    uint32_t* s_lut_ptr = s_mem;                    // [LUT_ENTRIES][LUT_COPIES] packed pairs
    uint32_t* s_ring_ptr = s_mem + Cfg::LUT_WORDS;  // [WARPS][STAGES][STAGE_WORDS]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wn = warp % Cfg::WARPS_N, wk = warp / Cfg::WARPS_N;
    const int n16_base = (blockIdx.x * Cfg::WARPS_N + wn) * Cfg::MT;
    const int m_base = blockIdx.z * Cfg::TILE_M;
    // k-steps of this warp: split chunk, then contiguous sub-chunk of warp wk
    const int split_begin = blockIdx.y * p.ks_per_split;
    const int split_end = min(split_begin + p.ks_per_split, p.k_steps);
    const int split_len = max(split_end - split_begin, 0);
    const int per_warp = (split_len + Cfg::WARPS_K - 1) / Cfg::WARPS_K;
    const int k_begin = split_begin + wk * per_warp;
    const int k_end = min(k_begin + per_warp, split_end);
    const int n_steps = max(k_end - k_begin, 0);

    const uint32_t s_lut = (uint32_t)__cvta_generic_to_shared(s_lut_ptr);
    const int stage_words = Cfg::stage_words(p.a_rows);
    const int stages = Cfg::stages_for(p.a_rows);
    const uint32_t s_ring = (uint32_t)__cvta_generic_to_shared(s_ring_ptr) + 4 * warp * stages * stage_words;
    constexpr int A_OFF_BYTES = 4 * (Cfg::STAGE_W_WORDS + Cfg::STAGE_ABS_WORDS);
    const uint32_t lane_off = (uint32_t)(lane % Cfg::LUT_COPIES) * Cfg::LUT_ENTRY_BYTES;

    float acc[Cfg::MT][Cfg::MB][4];
    zero_acc<Cfg>(acc);

    // prologue: stages-1 k-steps in flight (empty groups keep the wait count uniform)
    StreamCursor<Cfg> cur;
    cur.init(p, n16_base, m_base, k_begin, lane);
    for (int st = 0; st < stages - 1; st++) {
        if (st < n_steps) {
            load_stage_async<Cfg>(s_ring + 4 * st * stage_words, cur, lane);
            if constexpr (Cfg::A_IN_RING) load_a_async<Cfg>(s_ring + 4 * st * stage_words + A_OFF_BYTES, cur, p, lane);
            cur.advance();
        }
        cp_async_commit();
    }
    uint4 r_a[UNIT_BLOCKS][Cfg::MB]; // A_IN_RING == false: this k-step's fragments
    if (!Cfg::A_IN_RING && n_steps > 0) load_a_registers<Cfg>(r_a, p, m_base, k_begin, lane);
    build_lut<Cfg, T, Cfg::MB == 1>(s_lut_ptr, cb_entry, p); // overlaps the prologue's DRAM latency
    __syncthreads();                                         // LUT complete
    if (!Cfg::A_IN_RING && n_steps > 0) // the first k-step's A chunks into B fragments (after the loads' latency)
#pragma unroll
        for (int blk = 0; blk < UNIT_BLOCKS; blk++)
#pragma unroll
            for (int mb = 0; mb < Cfg::MB; mb++) quad_transpose_words(r_a[blk][mb], lane % 4);

    uint32_t s_st_load = s_ring + 4 * (stages - 1) * stage_words; // ring slot of step i + stages - 1
    uint32_t s_st_comp = s_ring;                                   // ring slot of step i
    const uint32_t s_ring_end = s_ring + 4 * stages * stage_words;
    for (int i = 0; i < n_steps; i++) {
        if constexpr (Cfg::A_IN_RING) __syncwarp(); // every lane's reads of the slot refilled next are done
        if (i + stages - 1 < n_steps) {
            load_stage_async<Cfg>(s_st_load, cur, lane);
            if constexpr (Cfg::A_IN_RING) load_a_async<Cfg>(s_st_load + A_OFF_BYTES, cur, p, lane);
            cur.advance();
        }
        cp_async_commit();
        s_st_load += 4 * stage_words;
        if (s_st_load == s_ring_end) s_st_load = s_ring;
        uint4 r_a_next[UNIT_BLOCKS][Cfg::MB];
        if (!Cfg::A_IN_RING && i + 1 < n_steps) load_a_registers<Cfg>(r_a_next, p, m_base, k_begin + i + 1, lane);
        cp_async_wait_dyn(stages - 1); // this lane's copies of step i have landed
        if constexpr (Cfg::A_IN_RING) __syncwarp(); // ... and the other lanes' A chunks, which ldmatrix reads
        compute_stage<Cfg, T>(acc, s_st_comp, s_lut, lane_off, p.a_rows, r_a, lane);
        s_st_comp += 4 * stage_words;
        if (s_st_comp == s_ring_end) s_st_comp = s_ring;
        if (!Cfg::A_IN_RING && i + 1 < n_steps) {
#pragma unroll
            for (int blk = 0; blk < UNIT_BLOCKS; blk++)
#pragma unroll
                for (int mb = 0; mb < Cfg::MB; mb++) { // loaded a k-step ago: the shuffles do not wait
                    r_a[blk][mb] = r_a_next[blk][mb];
                    quad_transpose_words(r_a[blk][mb], lane % 4);
                }
        }
    }
    cp_async_wait<0>();
    allow_dependent_launch(); // past its loads: the next GEMM may take the SM slots this grid's CTAs leave
    __syncthreads(); // ring free: reuse it for the k-reduction

    // k-reduction across the WARPS_K warps of the CTA, in wk order (the ring is free: reuse it)
    reduce_warps_k<Cfg>(acc, reinterpret_cast<float*>(s_ring_ptr), wn, wk, lane);
    const int n_base_warp = n16_base * UNIT_ROWS;
    if (p.k_splits > 1) {
        const int tile_id = blockIdx.z * gridDim.x + blockIdx.x;
        if (!reduce_split_k<Cfg>(acc, p, tile_id, wn, wk == 0, lane, &s_flag)) return;
    }
    if (wk == 0) store_output<Cfg, T>(acc, p, n_base_warp, m_base, lane);
}


// ---------------------------------------------------------------------------------------------
// Shared-A path: the same per-warp weight stream and LUT dequant, but the A tile of each k-step is
// staged ONCE per CTA in a shared cp.async ring (all 8 warps, along n, use the same k-step, so the CTA
// is synchronized once per k-step) and read with ldmatrix (rows padded by 16 bytes: conflict-free).
// MB = 8 ("wide", TILE_M = 64, 226 KB: one CTA per SM, sm_90) serves M > 32; MB = 1, 2, 4 (TILE_M =
// 8, 16, 32, 112 KB: two CTAs per SM) serve M <= 32 on all but small weights (and MB = 2 small
// weights up to M = 128). Each dequantized fragment feeds MB MMAs. Split-K up to M = 256, through the
// same workspace slots as configs 0-1. MB = 1, 2 keep their weights in registers instead of the smem
// ring (W_REG_STAGES, section 4).
// ---------------------------------------------------------------------------------------------
// k-steps of weights in flight in registers at MB = 1 (0: the smem ring): 2, but 3 for k = 2 with one warp along k
// (configs 2, 10). H100, M = 1, back to back, us, 3 -> 2 deep, k = 2 / 3 / 4 / 5: 4096 x 14336 (config 8) 11.3 / 13.2 /
// 14.8 / 18.7 -> 10.9 / 12.4 / 13.9 / 17.4; 14336 x 4096 (config 10) 11.3 / 13.2 / 14.6 / 17.4 -> 11.5 /
// 12.6 / 13.8 / 16.7; 8192 x 8192 12.1 / 14.1 / 15.9 / 19.6 -> 12.3 / 13.5 / 15.4 / 18.8; 28672 x 8192 33.5 / 41.6 / 46.9
// / 57.9 -> 33.7 / 39.8 / 46.3 / 55.7; 4096 x 4096 (config 8) 5.8 / 6.6 / 7.0 -> 5.9-6.0 / 6.3 / 7.0
#ifndef KBIT_W_REG_STAGES_MB1
#define KBIT_W_REG_STAGES_MB1 2
#endif
#ifndef KBIT_W_REG_STAGES_MB1_K2_WK1
#define KBIT_W_REG_STAGES_MB1_K2_WK1 3
#endif
#ifndef KBIT_W_REG_STAGES_MB2
#define KBIT_W_REG_STAGES_MB2 2
#endif
#ifndef KBIT_W_REG_STAGES_MB2_K2
#define KBIT_W_REG_STAGES_MB2_K2 KBIT_W_REG_STAGES_MB2
#endif
#ifndef KBIT_W_REG_STAGES_MB4
#define KBIT_W_REG_STAGES_MB4 0
#endif
#ifndef KBIT_A_STEPS_PER_BARRIER // register-weight configs: k-steps of A per CTA barrier (1: a barrier per k-step)
#define KBIT_A_STEPS_PER_BARRIER 2
#endif
#ifndef KBIT_A_STAGES_REG // register-weight configs: k-steps of A in the shared ring (a multiple of the above, >= 2x)
#define KBIT_A_STAGES_REG 4
#endif
template <int K_BITS_, int MB_, int MT_, int CTAS_PER_SM_, bool ABS_U8_, int WARPS_K_ = 1, int WARPS_N_ = 8 / WARPS_K_,
          bool BLOCK_COLUMNS_ = false>
struct KbitSharedAConfig : KbitGemmConfig<K_BITS_, MB_, MT_, WARPS_N_, WARPS_K_, ABS_U8_, true, BLOCK_COLUMNS_> {
    using Base = KbitGemmConfig<K_BITS_, MB_, MT_, WARPS_N_, WARPS_K_, ABS_U8_, true, BLOCK_COLUMNS_>;
    static_assert(WARPS_N_ * WARPS_K_ == 8 || (WARPS_K_ == 1 && WARPS_N_ == 7) ||
                      ((WARPS_N_ * WARPS_K_ == 16 || WARPS_N_ * WARPS_K_ == 14) && CTAS_PER_SM_ == 1),
                  "8 warps = WARPS_N x WARPS_K, 7 along n (224-row tiles), or 16 or 14 in a CTA per SM (configs 11, 13)");
    // With WARPS_K > 1 the CTA's k-steps are cut into WARPS_K contiguous chunks (one per warp along k, so each warp
    // streams its weight rows in order); a "CTA step" is step i of every chunk: an A slot holds WARPS_K k-steps
    static constexpr int A_STEP_K = UNIT_K * WARPS_K_;
    // + 16 bytes: the 8 rows of an ldmatrix phase (16 bytes each, an odd number of chunks apart) hit distinct banks
    static constexpr int A_ROW_BYTES = 2 * A_STEP_K + 16;
    static constexpr int A_STAGE_WORDS = Base::TILE_M * A_ROW_BYTES / 4;
    static constexpr int W_STAGE_WORDS = Base::STAGE_W_WORDS + Base::STAGE_ABS_WORDS; // per warp
    // W_REG_STAGES > 0: the weights skip shared memory; each lane loads its own words (ld.global.nc) into a
    // register ring that many k-steps deep (section 4) and the smem ring holds only A
    static constexpr int W_REG_STAGES = MB_ == 1   ? (K_BITS_ == 2 && WARPS_K_ == 1 ? KBIT_W_REG_STAGES_MB1_K2_WK1
                                                                                 : KBIT_W_REG_STAGES_MB1)
                                        : MB_ == 2 ? (K_BITS_ == 2 ? KBIT_W_REG_STAGES_MB2_K2 : KBIT_W_REG_STAGES_MB2)
                                        : MB_ == 4 ? KBIT_W_REG_STAGES_MB4
                                                   : 0;
    static_assert(WARPS_K_ == 1 || W_REG_STAGES > 0, "warps along k only with the weights in registers");
    static constexpr int W_SMEM_STAGE_WORDS = W_REG_STAGES > 0 ? 0 : W_STAGE_WORDS;
    static constexpr int SHARED_A_CTAS_PER_SM = CTAS_PER_SM_;
    static_assert(CTAS_PER_SM_ == 1 || CTAS_PER_SM_ == 2, "one CTA per SM (226 KB, sm_90) or two (112 KB)");
    static constexpr int SHARED_A_BUDGET_BYTES = CTAS_PER_SM_ == 1 ? 226 * 1024 : 112 * 1024;
    static constexpr int SHARED_A_STAGES_FIT =
        (SHARED_A_BUDGET_BYTES / 4 - Base::LUT_WORDS) / (A_STAGE_WORDS + Base::WARPS * W_SMEM_STAGE_WORDS);
    // the register-weight configs refill A P CTA steps at a time, one barrier per P steps (section 4), where
    // two refills fit (wide A slots of WARPS_K k-steps may not: then a barrier per step)
    static constexpr int A_STEPS_PER_BARRIER =
        W_REG_STAGES > 0 && SHARED_A_STAGES_FIT >= 2 * KBIT_A_STEPS_PER_BARRIER ? KBIT_A_STEPS_PER_BARRIER : 1;
    static constexpr int STAGES_CAP = W_REG_STAGES > 0 ? KBIT_A_STAGES_REG : 4;
    static constexpr int SHARED_A_STAGES =
        (SHARED_A_STAGES_FIT > STAGES_CAP ? STAGES_CAP : SHARED_A_STAGES_FIT) / A_STEPS_PER_BARRIER * A_STEPS_PER_BARRIER;
    static_assert(SHARED_A_STAGES % A_STEPS_PER_BARRIER == 0 && SHARED_A_STAGES >= 2 * A_STEPS_PER_BARRIER,
                  "the A ring holds whole refills, two or more");
    // 2 stages still overlap (the barrier of step i frees the slot of step i-1 for step i+1) but keep one
    // k-step in flight; MB = 4 at k >= 4 (and fp16 absmax at MB = 2) only fit 2 in 112 KB
    static_assert(SHARED_A_STAGES >= 2, "the shared ring needs >= 2 stages (one barrier per k-step)");
    static constexpr int SHARED_A_SMEM_BYTES =
        4 * (Base::LUT_WORDS + SHARED_A_STAGES * (A_STAGE_WORDS + Base::WARPS * W_SMEM_STAGE_WORDS));
    // push_split_k's receive slot (one C tile of fp32) after the rest, in launches of 2-CTA clusters only
    static constexpr int PUSH_RECV_OFFSET = (SHARED_A_SMEM_BYTES + 15) / 16 * 16;
    static constexpr int PUSH_SMEM_BYTES = PUSH_RECV_OFFSET + 4 * Base::TILE_FLOATS;
    static_assert(Base::RED_WORDS <= SHARED_A_STAGES * A_STAGE_WORDS, "the k-reduction buffer aliases the A ring");
    static constexpr int A_CHUNKS = Base::TILE_M * (A_STEP_K / 8); // 16-byte chunks of one A stage
    static constexpr int A_CHUNKS_PER_THREAD = (A_CHUNKS + Base::THREADS - 1) / Base::THREADS;
    // the last round of a tile's chunks leaves threads idle where THREADS does not divide A_CHUNKS (7-warp CTAs)
    static constexpr bool A_CHUNKS_RAGGED = A_CHUNKS % Base::THREADS != 0;
    // Two token tiles (configs 3, 9): each lane's codebook entry is the kernel's first copy (cp.async, 4 bytes,
    // into its warp's 128 bytes of the last A slot, which the prefill leaves free until the loop's first refill),
    // and A's prefill goes out before the weights. Loaded into a register after the weight loads, as before, the
    // codebook waited behind them: per-CTA %globaltimer marks (dev/probe_timeline.py, H100) had 2.3-3.3 us from
    // entry to the built LUT at M = 16 against 1.1 at M = 1, where one tile's kernels load it first into a register
    // (in config 3 that register made ptxas rematerialize a thread index in the loop: 9-14% slower). H100, us, M = 16,
    // k = 2 / 3 / 4 / 5, paths interleaved, two rounds: 14336 x 4096 16.3 / 17.8 / 19.0 / 23.0 -> 15.5 / 17.4 / 18.3
    // / 22.4; 4096 x 14336 16.8 / 18.8 / 20.1 / 24.1 -> 15.7 / 17.9 / 19.1 / 24.1; 8192 x 8192 17.2 / 19.6 / 20.9 /
    // 24.9 -> 16.5 / 18.4 / 20.0 / 23.6; 28672 x 8192 44.7 / 55.3 / 58.1 / 71.0 -> 44.4 / 54.3 / 57.9 / 69.6. The
    // codebook alone by cp.async, A still after the weights, had A's first wait grow by as much (k = 3 slower). For
    // one token tile the cp.async codebook was -3..+5% (4096 x 14336 k = 3 14.9 -> 15.6): kept in a register.
    static constexpr bool CODEBOOK_BY_CP_ASYNC = MB_ == 2 && W_REG_STAGES > 0;
    static_assert(!CODEBOOK_BY_CP_ASYNC || Base::WARPS * 128 <= 4 * A_STAGE_WORDS,
                  "the codebook copies fit the last A slot, which the prefill (S - P slots) leaves free");
};

// this lane's word of the codebook copies in the last A slot (CODEBOOK_BY_CP_ASYNC)
template <class Cfg> __device__ __forceinline__ uint32_t codebook_slot(uint32_t s_a_ring) {
    return s_a_ring + 4 * (Cfg::SHARED_A_STAGES - 1) * Cfg::A_STAGE_WORDS + (threadIdx.x / 32) * 128 +
           (threadIdx.x % 32) * 4;
}

// cooperative copy of the A tile [TILE_M tokens][A_STEP_K k] of one CTA step into the shared ring: k-step
// kstep + wk * chunk_steps for each warp wk along k, zero past k_end (the split's end: the last chunk may be
// shorter, and its warp multiplies whatever its weight registers hold by these zeros)
template <class Cfg>
__device__ __forceinline__ void load_a_shared_async(uint32_t s_a, const KbitGemmParams& p, int m_base, int kstep,
                                                    int chunk_steps = 0, int k_end = 0) {
    const unsigned short* g_A = reinterpret_cast<const unsigned short*>(p.A);
    if constexpr (Cfg::BLOCK_COLUMNS) {
        // One token (M = 1): the k-step's 64 words of each warp along k, word 4j + t of block b (k 32b + 8j + 2t, +1:
        // register j of lane (b, t)'s B fragment) stored at word 4t + j of the block's 64 bytes, so lane (b, t) reads
        // its four registers with one 16-byte load (compute_units_block_columns)
        constexpr int WORDS = Cfg::WARPS_K * (UNIT_K / 2); // 64 per warp along k: more than THREADS for config 12
#pragma unroll
        for (int r = 0; r < (WORDS + Cfg::THREADS - 1) / Cfg::THREADS; r++) {
            const int x = threadIdx.x + r * Cfg::THREADS;
            if (x >= WORDS) return;
            const int seg = x / (UNIT_K / 2), w = x % (UNIT_K / 2);
            const int blk = w / 16, j = (w % 16) / 4, t = w % 4;
            const int k = (kstep + seg * chunk_steps) * UNIT_K + 2 * (w % 16) + blk * BLOCK_ELEMS;
            const bool ok = k < p.K_dim && (Cfg::WARPS_K == 1 || k < k_end * UNIT_K);
            const unsigned short* src = ok ? g_A + (long long)m_base * p.lda + k : g_A;
            const uint32_t s_dst = s_a + seg * 2 * UNIT_K + blk * 64 + (4 * t + j) * 4;
            if (p.a_vec_ok) {
                cp_async_4_zfill(s_dst, src, ok ? 4u : 0u);
            } else { // A only 2-byte aligned: two loads and a 4-byte store (ordered by the ring's barrier)
                const uint32_t v = ok ? (uint32_t)src[0] | ((uint32_t)src[1] << 16) : 0u;
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_dst), "r"(v));
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < Cfg::A_CHUNKS_PER_THREAD; j++) {
            const int c = threadIdx.x + j * Cfg::THREADS;
            if (Cfg::A_CHUNKS_RAGGED && c >= Cfg::A_CHUNKS) break; // MB = 1: half the threads copy
            const int row = c / (Cfg::A_STEP_K / 8), piece = c % (Cfg::A_STEP_K / 8);
            const int seg = Cfg::WARPS_K == 1 ? 0 : piece / (UNIT_K / 8); // the warp along k that reads it
            const int m = m_base + row, k = (kstep + seg * chunk_steps) * UNIT_K + (piece % (UNIT_K / 8)) * 8;
            if (m >= p.M) continue;                  // rows >= M are never read (compute clamps to the last row)
            const bool ok = k < p.K_dim && (Cfg::WARPS_K == 1 || k < k_end * UNIT_K); // zero fill: padded k must be 0
            const unsigned short* src = ok ? g_A + (long long)m * p.lda + k : g_A;
            const uint32_t s_dst = s_a + row * Cfg::A_ROW_BYTES + piece * 16;
            if (p.a_vec_ok) {
                cp_async_16_zfill(s_dst, src, ok ? 16u : 0u);
            } else {
                sts128(s_dst, ok ? ldg_a_unaligned(src) : make_uint4(0, 0, 0, 0));
            }
        }
    }
}

// dequant + MMA of one k-step: this lane's weight words and absmax of its MT units (from the smem ring or
// the register ring), A from the shared slot s_a.
// a_off[mb]: this lane's ldmatrix row address (token mb*8 + lane % 8, clamped to the tile's last row < M: rows
// past M are not copied; at M < 8 the lanes then share rows and the read broadcasts; chunk lane / 8 of a block)
template <class Cfg, typename T>
__device__ __forceinline__ void compute_units_shared_a(float (&acc)[Cfg::MT][Cfg::MB][4],
                                                       const uint32_t (&r_w)[Cfg::MT][Cfg::Fmt::LANE_WORDS],
                                                       const uint32_t (&r_abs)[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4],
                                                       uint32_t s_a, const uint32_t (&a_off)[Cfg::MB], uint32_t s_lut,
                                                       uint32_t lane_off) {
#ifdef KBIT_PROBE_ONE_LDMATRIX // timing probe only: every block reads block 0's token fragments (wrong values)
    constexpr uint32_t A_BLOCK_BYTES = 0;
#else
    constexpr uint32_t A_BLOCK_BYTES = 2 * BLOCK_ELEMS; // a quantization block of one token row
#endif
#define KBIT_SHARED_A_BLOCK(BLK)                                                                                    \
    {                                                                                                           \
        uint4 r_b[Cfg::MB];                                                                                     \
        _Pragma("unroll") for (int mb = 0; mb < Cfg::MB; mb++) ldmatrix_b_frags(r_b[mb], s_a + a_off[mb] + (BLK) * A_BLOCK_BYTES); \
        _Pragma("unroll") for (int mt = 0; mt < Cfg::MT; mt++)                                                  \
            block_mma<Cfg, T, BLK>(acc[mt], r_w[mt], r_abs[mt], r_b, s_lut, lane_off);                          \
    }
    KBIT_SHARED_A_BLOCK(0) KBIT_SHARED_A_BLOCK(1) KBIT_SHARED_A_BLOCK(2) KBIT_SHARED_A_BLOCK(3)
#undef KBIT_SHARED_A_BLOCK
}

// BLOCK_COLUMNS (M = 1; section 3): the MMA's 8 token columns are idle but one, so block BLK of a k-step is
// multiplied into column BLK alone: lane (g, t) of g < 4 loads its four B-fragment registers of block g with one
// 16-byte load (the A slot's quad-major order, load_a_shared_async; a_off = block g, lane t), and its B fragment is
// that in block g's MMAs and zero in the others (lanes g >= 4: zero throughout). d[mt] then holds the k-step's 4
// unscaled block sums of each row (the LUT holds bare codebook values), scaled once per k-step in fp32: 4 FFMA per
// unit instead of 32 HMUL2 and 8 scale pairs. fold_block_columns sums the columns of each row after the loop.
template <class Cfg, typename T>
__device__ __forceinline__ void compute_units_block_columns(float (&acc)[Cfg::MT][Cfg::MB][4],
                                                            const uint32_t (&r_w)[Cfg::MT][Cfg::Fmt::LANE_WORDS],
                                                            const uint32_t (&r_abs)[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4],
                                                            uint32_t s_a, uint32_t a_off, uint32_t s_lut,
                                                            uint32_t lane_off, int lane) {
    float d[Cfg::MT][4];
    uint4 r_a = make_uint4(0u, 0u, 0u, 0u);
    if (lane < 16) r_a = lds128_ring(s_a + a_off); // 2 wavefronts per k-step, against 16 for 4 ldmatrix.x4
    const int g = lane / 4;
#define KBIT_BLOCK_COLUMN(BLK)                                                                                      \
    {                                                                                                           \
        const bool mine = g == (BLK);                                                                           \
        const uint4 r_b = make_uint4(mine ? r_a.x : 0u, mine ? r_a.y : 0u, mine ? r_a.z : 0u, mine ? r_a.w : 0u); \
        _Pragma("unroll") for (int mt = 0; mt < Cfg::MT; mt++) {                                                \
            uint32_t frag0[4], frag1[4];                                                                        \
            lookup_frag_a<Cfg, 2 * (BLK)>(frag0, r_w[mt], s_lut, lane_off);                                     \
            lookup_frag_a<Cfg, 2 * (BLK) + 1>(frag1, r_w[mt], s_lut, lane_off);                                 \
            if ((BLK) == 0) d[mt][0] = d[mt][1] = d[mt][2] = d[mt][3] = 0.0f;                                   \
            mma_m16n8k16(d[mt], frag0, r_b.x, r_b.y, T());                                                      \
            mma_m16n8k16(d[mt], frag1, r_b.z, r_b.w, T());                                                      \
        }                                                                                                       \
    }
    KBIT_BLOCK_COLUMN(0) KBIT_BLOCK_COLUMN(1) KBIT_BLOCK_COLUMN(2) KBIT_BLOCK_COLUMN(3)
#undef KBIT_BLOCK_COLUMN
    // d0, d1: row g, columns (blocks) 2t, 2t + 1; d2, d3: row g + 8. Lanes t = 2, 3 hold the empty columns 4..7.
    const bool odd = lane & 1;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        uint32_t r_sel[Cfg::ABS_BYTES_PER_LANE / 4]; // this lane's two blocks moved to blocks 0, 1 of each row
        if constexpr (Cfg::ABS_U8) {
            r_sel[0] = r_abs[mt][0] >> (odd ? 16 : 0);
            r_sel[1] = r_abs[mt][1] >> (odd ? 16 : 0);
        } else {
            r_sel[0] = odd ? r_abs[mt][1] : r_abs[mt][0];
            r_sel[1] = 0u;
            r_sel[2] = odd ? r_abs[mt][3] : r_abs[mt][2];
            r_sel[3] = 0u;
        }
        acc[mt][0][0] = fmaf(scale_f32<Cfg>(r_sel, 0), d[mt][0], acc[mt][0][0]);
        acc[mt][0][1] = fmaf(scale_f32<Cfg>(r_sel, 1), d[mt][1], acc[mt][0][1]);
        acc[mt][0][2] = fmaf(scale_f32<Cfg>(r_sel, 4), d[mt][2], acc[mt][0][2]);
        acc[mt][0][3] = fmaf(scale_f32<Cfg>(r_sel, 5), d[mt][3], acc[mt][0][3]);
    }
}

// BLOCK_COLUMNS after the loop: each row's sum over its 8 columns (4 lanes x 2 registers) as token 0's value
template <class Cfg> __device__ __forceinline__ void fold_block_columns(float (&acc)[Cfg::MT][Cfg::MB][4]) {
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        float r_g = acc[mt][0][0] + acc[mt][0][1], r_g8 = acc[mt][0][2] + acc[mt][0][3];
        r_g += __shfl_xor_sync(0xffffffffu, r_g, 1);
        r_g8 += __shfl_xor_sync(0xffffffffu, r_g8, 1);
        r_g += __shfl_xor_sync(0xffffffffu, r_g, 2);
        r_g8 += __shfl_xor_sync(0xffffffffu, r_g8, 2);
        acc[mt][0][0] = r_g;
        acc[mt][0][1] = 0.0f;
        acc[mt][0][2] = r_g8;
        acc[mt][0][3] = 0.0f;
    }
}

// A lane's weights of one k-step (MT units) in registers: one slot of the W_REG_STAGES-deep register ring
template <class Cfg> struct StepWeightRegs {
    uint32_t w[Cfg::MT][Cfg::Fmt::LANE_WORDS];
    uint32_t abs[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4];
};

// non-coherent global loads that do not allocate in L1 (each weight byte is read once); PTX ISA 9.7.9.8
__device__ __forceinline__ void ldg_stream_v4(uint32_t* r, const void* g_ptr) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(g_ptr));
}
__device__ __forceinline__ void ldg_stream_v2(uint32_t* r, const void* g_ptr) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "l"(g_ptr));
}

// the same words load_stage_async copies into the smem ring, into registers
template <class Cfg>
__device__ __forceinline__ void load_units_to_regs(StepWeightRegs<Cfg>& r, const StreamCursor<Cfg>& cur, int lane) {
    using F = typename Cfg::Fmt;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; mt++) {
        // One token tile loads absent units (n16 >= n16_tiles) too: their pointer is clamped to the last unit row, and the
        // unpredicated loads let ptxas use the cursor registers as they are (the skip cost 2 moves per pointer and k-step).
        // H100, M = 1, k = 2, us, two processes each: 4096 x 14336 10.4 -> 10.1-10.2, 28672 x 8192 31.1-31.2 -> 29.7-29.8;
        // two token tiles were up to 1.4% slower without the skip (docs/kernel.md, "The absent-unit skip").
        if (Cfg::MB > 1 && !((cur.valid_mt >> mt) & 1)) continue; // warp-uniform; stale registers only feed unstored rows
#pragma unroll
        for (int c = 0; c < F::NV4; c++) ldg_stream_v4(&r.w[mt][4 * c], cur.g_w[mt] + c * 128);
        if constexpr (F::HAS_V2) ldg_stream_v2(&r.w[mt][4 * F::NV4], cur.g_w[mt] + F::NV4 * 128 - lane * 2);
        if constexpr (Cfg::ABS_U8) ldg_stream_v2(r.abs[mt], cur.g_abs[mt]);
        else ldg_stream_v4(r.abs[mt], cur.g_abs[mt]);
    }
}

// the k-loop with the weights in the smem ring: step i waits for its stage, one barrier, refills the slot
// step i-1 used with step i+S-1 (weights + A), then dequantizes + multiplies step i
template <class Cfg, typename T>
__device__ __forceinline__ void shared_a_loop_smem_ring(float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                                        StreamCursor<Cfg>& cur, int k_begin, int n_steps, int m_base,
                                                        uint32_t s_a_ring, uint32_t s_w_ring,
                                                        const uint32_t (&a_off)[Cfg::MB], uint32_t* s_lut_ptr,
                                                        float cb_entry, uint32_t lane_off, int lane) {
    constexpr int S = Cfg::SHARED_A_STAGES;
    const uint32_t s_lut = (uint32_t)__cvta_generic_to_shared(s_lut_ptr);
    for (int st = 0; st < S - 1; st++) { // prologue: S-1 k-steps in flight
        if (st < n_steps) {
            load_stage_async<Cfg>(s_w_ring + 4 * st * Cfg::W_STAGE_WORDS, cur, lane);
            load_a_shared_async<Cfg>(s_a_ring + 4 * st * Cfg::A_STAGE_WORDS, p, m_base, k_begin + st);
            cur.advance();
        }
        cp_async_commit();
    }
    build_lut<Cfg, T, Cfg::MB == 1>(s_lut_ptr, cb_entry, p);

    for (int i = 0; i < n_steps; i++) {
        cp_async_wait<S - 2>(); // step i landed (this thread's copies) ...
        __syncthreads();        // ... everyone's, and everyone is done with step i-1's slot (and the LUT)
        const int st_load = (i + S - 1) % S;
#ifdef KBIT_PROBE_NO_LOADS // timing probe only (section 7): compute on stale ring data
        if (false) {
#else
        if (i + S - 1 < n_steps) {
#endif
            load_stage_async<Cfg>(s_w_ring + 4 * st_load * Cfg::W_STAGE_WORDS, cur, lane);
            load_a_shared_async<Cfg>(s_a_ring + 4 * st_load * Cfg::A_STAGE_WORDS, p, m_base, k_begin + i + S - 1);
            cur.advance();
        }
        cp_async_commit();
        const int st = i % S;
#ifndef KBIT_PROBE_NO_COMPUTE // timing probe only (section 7): copies without the dequant/MMA
        uint32_t r_w[Cfg::MT][Cfg::Fmt::LANE_WORDS];
        uint32_t r_abs[Cfg::MT][Cfg::ABS_BYTES_PER_LANE / 4];
#pragma unroll
        for (int mt = 0; mt < Cfg::MT; mt++)
            read_unit_from_stage<Cfg>(r_w[mt], r_abs[mt], s_w_ring + 4 * st * Cfg::W_STAGE_WORDS, mt, lane);
        compute_units_shared_a<Cfg, T>(acc, r_w, r_abs, s_a_ring + 4 * st * Cfg::A_STAGE_WORDS, a_off, s_lut, lane_off);
#endif
    }
}

#ifdef KBIT_PROBE_TIMELINE // timing probe only (dev/probe_timeline.py): %globaltimer at points of each CTA
__device__ unsigned long long g_kbit_timeline[16 * 65536]; // [CTA][16]: marks 0-6, 8-9; the SM in 7
__device__ __forceinline__ void timeline_mark(int j) {
    if (threadIdx.x != 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (cta < 65536) g_kbit_timeline[16 * cta + j] = t;
    if (j == 0) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        if (cta < 65536) g_kbit_timeline[16 * cta + 7] = smid;
    }
}
#define KBIT_TIMELINE(j) timeline_mark(j)
#else
#define KBIT_TIMELINE(j)
#endif

// the k-loop with the weights in registers (W_REG_STAGES = D): the loads of step i+D are issued right
// after step i's compute, into the registers it just used, so D k-steps of weights are in flight per
// lane; A still travels through the smem ring (S-1 steps ahead, one barrier per P steps). The loop is
// unrolled by D so every ring slot is a fixed set of registers. Steps are CTA steps (step i of each of the
// WARPS_K chunks of n_steps k-steps from k_begin to k_end, one per warp along k); this warp's chunk has
// my_steps of them (fewer in the last chunk of a split): past them it loads no weights and computes on zero A
// (no branch around the compute: one cost ptxas the overlap of consecutive steps).
template <class Cfg, typename T>
__device__ __forceinline__ void shared_a_loop_weight_regs(float (&acc)[Cfg::MT][Cfg::MB][4], const KbitGemmParams& p,
                                                          StreamCursor<Cfg>& cur, int k_begin, int k_end,
                                                          int n_steps, int my_steps, int m_base, uint32_t s_a_ring,
                                                          const uint32_t (&a_off)[Cfg::MB], uint32_t* s_lut_ptr,
                                                          float cb_entry, uint32_t lane_off, int lane) {
    constexpr int S = Cfg::SHARED_A_STAGES;
    constexpr int D = Cfg::W_REG_STAGES;
    const uint32_t s_lut = (uint32_t)__cvta_generic_to_shared(s_lut_ptr);
    constexpr int P = Cfg::A_STEPS_PER_BARRIER; // A arrives in refills of P k-steps, one commit group each
    const auto prefill_a = [&] {
        for (int st = 0; st < S - P; st++) {
            if (st < n_steps)
                load_a_shared_async<Cfg>(s_a_ring + 4 * st * Cfg::A_STAGE_WORDS, p, m_base, k_begin + st, n_steps, k_end);
            if (st % P == P - 1) cp_async_commit();
        }
    };
    // A's few hundred bytes go out before the weights, so their first wait is not queued behind the weight
    // loads (H100, M = 1, us: 14336 x 4096 k = 4 16.8 -> 16.2, k = 5 24.4 -> 23.3; 28672 x 8192 k = 5 76.0 ->
    // 74.0). With two token tiles this pays only with the codebook copied first (CODEBOOK_BY_CP_ASYNC).
    prefill_a();
    StepWeightRegs<Cfg> ring[D] = {}; // zeroed: slots of absent units (rows >= N) are never loaded
#pragma unroll
    for (int d = 0; d < D; d++)
        if (d < my_steps) {
            load_units_to_regs<Cfg>(ring[d], cur, lane);
            cur.advance();
        }
    if constexpr (Cfg::CODEBOOK_BY_CP_ASYNC) { // the kernel's first copy group: all but the A prefill's
        cp_async_wait<(S - P) / P>();
#ifdef KBIT_PROBE_CODEBOOK_CONST // timing probe only: no codebook copy (its group stays, empty)
        build_lut<Cfg, T, true>(s_lut_ptr, load_codebook_entry(p), p);
#else
        build_lut<Cfg, T, true>(s_lut_ptr, __uint_as_float(lds32(codebook_slot<Cfg>(s_a_ring))), p);
#endif
    } else {
        build_lut<Cfg, T, Cfg::MB == 1>(s_lut_ptr, cb_entry, p);
    }
    KBIT_TIMELINE(1);

    for (int i0 = 0; i0 < n_steps; i0 += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int i = i0 + d;
            if (i >= n_steps) break;
            if (i % P == 0) {
                cp_async_wait<S / P - 2>(); // A of steps i .. i+P-1 landed (this thread's copies) ...
                __syncthreads(); // ... everyone's, and everyone is done with steps i-P .. i-1 (and the LUT)
                if (i == 0) KBIT_TIMELINE(2);
#pragma unroll
                for (int q = 0; q < P; q++) { // steps i+S-P .. i+S-1 into the slots of i-P .. i-1
                    const int st = i + S - P + q;
#ifdef KBIT_PROBE_NO_A_REFILL // timing probe only: the loop computes on the prefill's A (wrong values)
                    if (false)
#else
                    if (st < n_steps)
#endif
                        load_a_shared_async<Cfg>(s_a_ring + 4 * (st % S) * Cfg::A_STAGE_WORDS, p, m_base, k_begin + st,
                                                 n_steps, k_end);
                }
                cp_async_commit();
            }
            // every load of this CTA is issued: the next GEMM may launch (PDL) while the last step computes. H100,
            // M = 1, us, after the k-loop -> here, back to back: 4096 x 4096 k = 3 7.3 -> 6.6, 4096 x 14336 13.4 /
            // 13.7 -> 13.3 / 13.3; the rest within 0.2 (k = 2, 3 of 14336 x 4096, M = 16, after an elementwise
            // kernel). 3 steps before the end: as fast at M = 1, 4096 x 14336 M = 16 17.3 -> 17.6.
            if (i == n_steps - 1) allow_dependent_launch();
#ifndef KBIT_PROBE_NO_COMPUTE
            if constexpr (Cfg::BLOCK_COLUMNS)
                compute_units_block_columns<Cfg, T>(acc, ring[d].w, ring[d].abs,
                                                    s_a_ring + 4 * (i % S) * Cfg::A_STAGE_WORDS, a_off[0], s_lut,
                                                    lane_off, lane);
            else
                compute_units_shared_a<Cfg, T>(acc, ring[d].w, ring[d].abs, s_a_ring + 4 * (i % S) * Cfg::A_STAGE_WORDS,
                                               a_off, s_lut, lane_off);
#endif
            if (i == 0) KBIT_TIMELINE(6);
#ifndef KBIT_PROBE_NO_LOADS
            if (i + D < my_steps) {
                load_units_to_regs<Cfg>(ring[d], cur, lane);
                cur.advance();
            }
#endif
        }
    }
}

// The first `steps` of this warp's k-steps from `kstep` on (weights and scales of its MT rows: one contiguous span
// each) into L2, one bulk prefetch per span (lanes 0..MT-1 the weights, MT..2MT-1 the scales).
template <class Cfg>
__device__ __forceinline__ void prefetch_warp_split_l2(const KbitGemmParams& p, int n16_base, int kstep, int steps,
                                                       int lane) {
    using F = typename Cfg::Fmt;
    constexpr int ABS_ELEM_BYTES = Cfg::ABS_U8 ? 1 : 2;
    const int mt = lane % Cfg::MT, n16 = n16_base + mt;
    if (steps <= 0 || lane >= 2 * Cfg::MT || n16 >= p.n16_tiles) return;
#ifdef KBIT_PROBE_UNIT_GROUP
    return; // the probe's order is not the one prefetched here
#endif
    const long long unit = (long long)n16 * p.k_steps + kstep;
    const char* g = lane < Cfg::MT ? reinterpret_cast<const char*>(p.B + unit * F::UNIT_WORDS)
                                   : reinterpret_cast<const char*>(p.B_absmax) + unit * UNIT_ABSMAX * ABS_ELEM_BYTES;
    const uint32_t bytes = (uint32_t)steps * (lane < Cfg::MT ? F::UNIT_WORDS * 4 : UNIT_ABSMAX * ABS_ELEM_BYTES);
    if ((reinterpret_cast<uintptr_t>(g) & 15) == 0) prefetch_l2_bulk(g, bytes);
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::SHARED_A_CTAS_PER_SM) kbit_gemm_shared_a_kernel(const KbitGemmParams p) {
    extern __shared__ __align__(16) uint32_t s_mem[];
    KBIT_TIMELINE(8);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wn = Cfg::WARPS_K == 1 ? warp : warp % Cfg::WARPS_N, wk = Cfg::WARPS_K == 1 ? 0 : warp / Cfg::WARPS_N;
    const int n16_base = (blockIdx.x * Cfg::WARPS_N + wn) * Cfg::MT;
    // k-steps of this split (blockIdx.y), cut into WARPS_K chunks of n_steps (warp wk: chunk wk, my_steps of
    // them); the whole CTA walks the same n_steps CTA steps
    constexpr int WK = Cfg::WARPS_K;
    const int k_begin = blockIdx.y * p.ks_per_split;
    const int split_len = max(min(k_begin + p.ks_per_split, p.k_steps) - k_begin, 0);
    const int n_steps = WK == 1 ? split_len : (split_len + WK - 1) / WK;
    const int my_steps = WK == 1 ? n_steps : min(max(split_len - wk * n_steps, 0), n_steps);
    __shared__ __align__(8) uint64_t s_push_bar; // push_split_k: an even split's receive barrier
    const uint32_t s_push_bar_addr = (uint32_t)__cvta_generic_to_shared(&s_push_bar);
    if (p.cluster_reduce) { // the even split's barrier exists before the odd one pushes (cluster_wait, push_split_k)
        if (threadIdx.x == 0 && blockIdx.y % 2 == 0) mbar_init(s_push_bar_addr, 1), fence_mbarrier_init_cluster();
        cluster_arrive_relaxed();
    }
    if (p.l2_prefetch_steps > 0 && blockIdx.z == 0) // before the PDL wait: a hint, no value comes back
        prefetch_warp_split_l2<Cfg>(p, n16_base, k_begin + wk * n_steps, min(my_steps, p.l2_prefetch_steps), lane);
    grid_dependency_wait(); // PDL (kbit_gemm.cu): every read and write of this grid comes after the previous kernel
    KBIT_TIMELINE(0);
    constexpr int S = Cfg::SHARED_A_STAGES;
    const float cb_entry = Cfg::MB == 1 ? load_codebook_entry(p) : 0.0f; // first: overlaps the prologue
    if constexpr (Cfg::CODEBOOK_BY_CP_ASYNC) {
        const uint32_t s_a_ring = (uint32_t)__cvta_generic_to_shared(s_mem) + 4 * Cfg::LUT_WORDS;
        const int l = threadIdx.x % 32;
#ifndef KBIT_PROBE_CODEBOOK_CONST
        cp_async_4_zfill(codebook_slot<Cfg>(s_a_ring), p.codebook + (l < p.codebook_len ? l : 0),
                         l < p.codebook_len ? 4u : 0u);
#else
        (void)l;
#endif
        cp_async_commit();
    }
    uint32_t* s_lut_ptr = s_mem;                                                 // [LUT_ENTRIES][LUT_COPIES]
    const uint32_t s_a_ring = (uint32_t)__cvta_generic_to_shared(s_mem) + 4 * Cfg::LUT_WORDS; // [S][TILE_M][A_ROW_BYTES]
    // this warp's weight ring [S][W_STAGE_WORDS] (none when the weights travel in registers)
    const uint32_t s_w_ring = s_a_ring + 4 * S * Cfg::A_STAGE_WORDS + 4 * warp * S * Cfg::W_SMEM_STAGE_WORDS;
    const int m_base = blockIdx.z * Cfg::TILE_M;
    __shared__ int s_flag;
    const uint32_t lane_off = (uint32_t)(lane % Cfg::LUT_COPIES) * Cfg::LUT_ENTRY_BYTES;
    uint32_t a_off[Cfg::MB];
    const int a_last_row = min(p.M - m_base, Cfg::TILE_M) - 1;
#pragma unroll
    for (int mb = 0; mb < Cfg::MB; mb++)
        a_off[mb] = Cfg::BLOCK_COLUMNS ? wk * 2 * UNIT_K + (lane % 16 / 4) * 64 + (lane % 4) * 16 // quad-major slot
                                       : min(mb * 8 + lane % 8, a_last_row) * Cfg::A_ROW_BYTES + wk * 2 * UNIT_K +
                                             (lane / 8) * 16;

    float acc[Cfg::MT][Cfg::MB][4];
    zero_acc<Cfg>(acc);

    StreamCursor<Cfg> cur;
    // One token tile: the weight streams start after the codebook's round trip (7-17% faster at M = 1, docs/kernel.md
    // "The codebook wait before the first loads"). ptxas chose that order by itself until an epilogue change moved
    // it; a zero that depends on the loaded entry (codebook_len <= 32) makes it part of the weights' addresses.
    const int after_codebook = Cfg::MB == 1 ? (int)(__float_as_uint(cb_entry) & ((uint32_t)p.codebook_len >> 16)) : 0;
    cur.init(p, n16_base, m_base, k_begin + wk * n_steps + after_codebook, lane);
    if constexpr (Cfg::W_REG_STAGES > 0)
        shared_a_loop_weight_regs<Cfg, T>(acc, p, cur, k_begin, k_begin + split_len, n_steps, my_steps, m_base, s_a_ring,
                                          a_off, s_lut_ptr, cb_entry, lane_off, lane);
    else
        shared_a_loop_smem_ring<Cfg, T>(acc, p, cur, k_begin, n_steps, m_base, s_a_ring, s_w_ring, a_off, s_lut_ptr,
                                        cb_entry, lane_off, lane);
    cp_async_wait<0>();
    if constexpr (Cfg::BLOCK_COLUMNS) fold_block_columns<Cfg>(acc);
    allow_dependent_launch(); // past its loads (the register loop allowed it at its last step already): the next GEMM
                              // may take the SM slots this grid's CTAs leave
    KBIT_TIMELINE(3);
    if constexpr (WK > 1) { // the A ring is free once every warp is past its last step: sum the k warps there
        __syncthreads();
        reduce_warps_k<Cfg>(acc, reinterpret_cast<float*>(s_mem + Cfg::LUT_WORDS), wn, wk, lane);
    }
    int split = blockIdx.y, n_splits = p.k_splits;
    if (p.cluster_reduce) { // pairs of splits as 2-CTA clusters: the odd one pushes its partial into the even one
        if (!push_split_k<Cfg>(acc, (uint32_t)__cvta_generic_to_shared(s_mem) + Cfg::PUSH_RECV_OFFSET, s_push_bar_addr,
                               wn, wk == 0, lane)) {
            KBIT_TIMELINE(9);
            return;
        }
        split /= 2, n_splits /= 2;
    }
#ifdef KBIT_PROBE_NO_SPLITK_REDUCE // timing probe only: every split stores its partial as C (wrong values)
    if (false) {
#else
    if (n_splits > 1) { // M <= 256 with few n tiles: same deterministic slot reduction as configs 0-2
#endif
        __syncthreads();
        const int tile_id = blockIdx.z * gridDim.x + blockIdx.x;
#ifndef KBIT_SPLITK_SHARED_READS
#define KBIT_SPLITK_SHARED_READS 1
#endif
        constexpr int READERS = KBIT_SPLITK_SHARED_READS && Cfg::MB >= 2 ? WK : 1;
        const bool last = reduce_split_k<Cfg>(acc, p, tile_id, wn, wk == 0, lane, &s_flag, CtaSync(), split, n_splits,
                                              READERS > 1 ? wk : 0, READERS);
        KBIT_TIMELINE(4);
        if (!last) return;
        if constexpr (READERS > 1) // the slot barriers above ordered the first k-reduction's reads before this
            reduce_warps_k<Cfg>(acc, reinterpret_cast<float*>(s_mem + Cfg::LUT_WORDS), wn, wk, lane);
    }
    if (wk == 0) store_output<Cfg, T>(acc, p, n16_base * UNIT_ROWS, m_base, lane);
    KBIT_TIMELINE(5);
}

} // namespace kbit
