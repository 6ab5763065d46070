/* placeholder until the kernels land */
#include "quants.h"
