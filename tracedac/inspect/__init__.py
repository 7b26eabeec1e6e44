"""What a region keeps for backward, for people: ``saved_report`` / ``print_saved`` (eager and
compiled) and ``trade_off`` (bytes kept against replay over budgets)."""
