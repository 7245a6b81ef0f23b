"""What the data, the model and the run layer all use: hardware detection (`core.hardware`), the typed config values
(`core.config_types`), the seeds of random draws (`core.seeding`) and the packages' names imported on first use
(`core.lazy`). It imports none of them."""
