// Preloaded into every process of `make test-sanitize`: dlclose() leaves
// each module loaded. LeakSanitizer then still names the module of what
// Open MPI's components allocated and kept, which tests/sanitizers/lsan.supp
// can match (Note [Leaks before MPI_Finalize] in
// tests/support/mpi_test_main.cpp); ThreadSanitizer stops a process that
// unloads a library its suppressions name, as MPI_Finalize would.
extern "C" int dlclose(void*) { return 0; }
