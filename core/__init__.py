"""What the data, the model and the run layer all use: hardware detection (`core.hardware`), the typed config values
(`core.config_types`) and the seeds of random draws (`core.seeding`). It imports none of them."""
