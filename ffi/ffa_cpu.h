// CPU handlers of the FFA custom calls (see ffa_interface.h for the interface).
#pragma once

#include "ffa_interface.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MagiFfaFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagiFfaBwdCpu);
