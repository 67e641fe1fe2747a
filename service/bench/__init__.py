"""What measures the engine: the `ngrammys` measurement commands' work (Spec-Bench runs, step
timings, speeds, the cost profile), the HTTP load clients and the references; imported by
neither the engine nor the HTTP edge."""
