"""Research probes: one question about a trained or base model (what the critic explains, where its value falls,
which mistake ends a response) answered from held-out samples; they print figures, not a pass/fail verdict."""
