"""Everything that turns runs into numbers: traces and metrics (10.2), workloads, the roofline
formulas and sweep (10.3), hardware ceilings, and the benchmark commands."""
