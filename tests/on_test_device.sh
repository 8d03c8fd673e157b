#!/usr/bin/env bash
# Runs PROGRAM ARGS... on the test device (docs/testing.md): with
# TESSERA_TEST_DEVICE=cuda it appends --device cuda --backend mpi, the ranks
# sharing the GPU through the MPI backend's host staging; unset or cpu, the
# command runs unchanged.
device=${TESSERA_TEST_DEVICE:-cpu}
[ "$device" = cpu ] && exec "$@"
exec "$@" --device "$device" --backend mpi
