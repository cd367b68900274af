#ifndef IAP_CZLIB_SHIM_H
#define IAP_CZLIB_SHIM_H

#include <zlib.h>

/* deflateInit2 and inflateInit are macros (they pass the library's version and the stream's
 * size), which do not import into Swift. */
static inline int iap_deflate_init(z_streamp stream, int level, int window_bits, int mem_level) {
    return deflateInit2(stream, level, Z_DEFLATED, window_bits, mem_level, Z_DEFAULT_STRATEGY);
}

static inline int iap_inflate_init(z_streamp stream) {
    return inflateInit(stream);
}

#endif
