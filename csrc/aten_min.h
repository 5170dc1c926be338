// csrc/aten_min.h — the ATen the ops' torch glue uses: at::Tensor with its methods, and the two
// factories it calls; not <ATen/ATen.h>, which declares every op and is slow to compile.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
