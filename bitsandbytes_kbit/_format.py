"""Facts of the k-bit storage formats that the op schemas and every backend share (no backend imports).

Flat format (quantize_kbit, checkpoints): blocks of BLOCKSIZE consecutive elements, k int32 words per block (word b
holds bit b of the 32 indices), one absmax per block. Tiled format (repack_kbit, read by kbit_gemm): units of
UNIT_ROWS rows x UNIT_K columns, 64 * k words and UNIT_ABSMAX scales per unit; N is padded to UNIT_ROWS and K to
UNIT_K. The constants must equal kbit::UNIT_ROWS, UNIT_K, BLOCK_ELEMS and UNIT_ABSMAX in csrc/kbit_gemm.cuh.
"""

BLOCKSIZE = 32  # elements per quantization block
SUPPORTED_K = (2, 3, 4, 5)

UNIT_ROWS = 16
UNIT_K = 128
UNIT_BLOCKS = UNIT_K // BLOCKSIZE  # 4 quantization blocks per unit row
UNIT_ABSMAX = UNIT_ROWS * UNIT_BLOCKS  # 64


def tiled_sizes(k: int, N: int, K_dim: int) -> tuple[int, int]:
    """(number of int32 words, number of absmax entries) of a weight [N, K_dim] in the tiled layout."""
    units = ((N + UNIT_ROWS - 1) // UNIT_ROWS) * ((K_dim + UNIT_K - 1) // UNIT_K)
    return units * 64 * k, units * UNIT_ABSMAX
