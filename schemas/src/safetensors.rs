//! safetensors folders: config.json plus header JSON, validated.
