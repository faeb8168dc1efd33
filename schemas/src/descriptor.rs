//! Descriptor TOML: hyperparameters plus a quant recipe, synthesized into an inventory.
