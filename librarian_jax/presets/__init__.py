"""Every command's presets: the values a run sets on its schema (`config_schema`), by preset name.

`configs/<command>.py` (what `--config=configs/grpo.py:qwen3_5_4b` loads) re-exports `get_config` from
here, so the package resolves a preset itself (a warm start's `configs/sft.py` preset, evaluation's
`train_preset`) and never imports the top-level `configs/` folder.
"""
