"""LoRA adapters served on a shared base model (issue #39): bundles read and checked against their base
(``engine.lora.adapter``)."""
