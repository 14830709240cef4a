// What a Magnetar CPU op takes from torch, and no more: tensors and their methods, at::parallel_for, the factories
// the ops call, and pybind11's tensor caster for PYBIND11_MODULE. <torch/extension.h> brings the whole C++
// frontend (torch::nn, optimisers, data loaders) with it: its headers alone compiled in 25 s against these 8 s on
// the 2-core VM, and every clean checkout (CI's) builds each op once.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>
