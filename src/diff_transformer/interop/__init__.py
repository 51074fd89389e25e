"""Moving weights between this project and other implementations (the authors' code, Hugging Face)."""
