// CPU handlers of the range ops (interface: range_ops_interface.h).
#pragma once

#include "range_ops_interface.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MagiRangeGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagiRangeScatterAddCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagiRangeScatterAddIntoCpu);
