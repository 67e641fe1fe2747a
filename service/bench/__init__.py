"""Tools that measure the engine (Spec-Bench runs, step timings, references); never imported by it."""
