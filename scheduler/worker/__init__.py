"""The worker side of the scheduler: what runs where an engine is (a worker process, or the
embedded engine thread). It alone imports the engine (`gpu_worker.engine`, torch); the rest of
the scheduler — submission, futures, placement, dispatch — runs in the API and never does."""
