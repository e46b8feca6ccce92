"""What the study's measurements mean for this machine: the step-cost model and the γ schedule it picks."""
