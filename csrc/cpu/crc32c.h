// crc32c.h - CRC32C (Castagnoli, the codec's checksum) folded with VPCLMULQDQ on AVX-512 CPUs.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvx::cpu {

// True when this CPU (and the OS) runs the AVX-512 VPCLMULQDQ path.
bool crc32c_accelerated();

// The CRC32C of data[0..n) continuing from `crc` (the CRC of the bytes before; 0 to start), as the
// crc32c package's crc32c(data, value). Only call where crc32c_accelerated().
uint32_t crc32c(uint32_t crc, const uint8_t* data, size_t n);

}  // namespace kvx::cpu
