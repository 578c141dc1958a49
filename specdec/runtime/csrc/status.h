/* What the kernels' entry points return (`specdec.runtime.native.KernelStatus` mirrors it). */
#ifndef SPECDEC_STATUS_H
#define SPECDEC_STATUS_H

enum specdec_status {
    SPECDEC_OK = 0,
    SPECDEC_BAD_SHAPE = -1,    /* a size outside what the kernel takes (head_dim, queries a row, rows) */
    SPECDEC_NO_MEMORY = -2,    /* its scratch memory could not be allocated */
    SPECDEC_PREFIX_WRITE = -3, /* a row's new keys/values would be stored inside its shared prefix */
    SPECDEC_OUT_OF_BOUNDS = -4, /* the call would read or write past a buffer it was given */
};

#endif
