"""dropless.monitor"""
