"""What a study's measurements mean: the typed analysis of a run (``study``), acceptance per token class
(``classes``), and this machine's step-cost model with the γ schedule it picks (``cost_model``, ``tune``)."""
