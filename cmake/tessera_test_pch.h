// Precompiled header shared by every test and example executable.
#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/torch.h>
