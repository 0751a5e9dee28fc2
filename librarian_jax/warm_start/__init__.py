"""The warm start before GRPO: scripted demonstrations run through the real agents (`demos`) and the SFT
loop and command that teach a model the tool protocol from them (`sft`; `configs/sft.py`).

Nothing is imported here: `config_schema` reads `demos`' style names, and `sft` builds on the config layers.
"""
