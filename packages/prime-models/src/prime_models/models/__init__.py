"""Model families. Each subpackage registers one `ModelSpec` keyed by HF `model_type`."""
