"""The config: typed schema (`schema`), composition with Hydra (`compose`), cross-field checks
(`validate`) and views of a composed config (`slices`). Orchestrator side: no torch."""
