// csrc/aten_min.h — the ATen the ops' torch glue uses: at::Tensor with its methods, and the two
// factories it calls. Not <ATen/ATen.h>: every op's declaration, most of a file's compile time.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
