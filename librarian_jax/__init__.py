"""librarian_jax: a JAX/Flax training stack for Librarian Agents.

A builder LLM turns a raw corpus into a workspace of synthetic, source-linked files; a frozen answerer
navigates it with list/read tools; the builder is trained with multi-turn GRPO on the answerer's accuracy.
See DESIGN.md for the layers and docs/contracts.md for the interfaces between them.
"""

__version__ = "0.1.0"

from librarian_jax import xla_flags as _xla_flags

_xla_flags.apply_defaults()  # before any JAX computation starts the backend (see xla_flags)
