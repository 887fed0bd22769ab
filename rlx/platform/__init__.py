"""What depends on the platform the programs run on: the compile cache that hands the
compiler's freed memory back (``compiled``).

May import only the foundation (``rlx.types``, ``rlx.errors``, ``rlx.mesh``).
"""
