// Precompiled header of the tessera library target (Note [Compile time] in
// docs/building.md). Only headers that most sources need anyway.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <mpi.h>
