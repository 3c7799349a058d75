"""Adapters inside the engine: the LoRAManager (manager.py: registry, host copies, device slots
and their policy), the slot buffers on the device (pool.py, with expert_slots.py for MoE
experts and full_modules.py for saved modules), and the manager's nouns (state.py)."""
