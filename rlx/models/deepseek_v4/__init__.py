"""DeepSeek-V4's own decoder (``model.DeepseekV4``): hyper-connection streams (``hyper``), its
attention (``attention``: sliding, compressed sparse and heavily compressed layers, with the
``compressor`` and the rotary tables of ``rope``), hash-routed and ``sqrtsoftplus``-routed experts
(``hash_moe``) and its tensor names (``weights``). The family (``rlx.models.families.deepseek_v4``)
reads and writes it."""
