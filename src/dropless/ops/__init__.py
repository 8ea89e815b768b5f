"""dropless.ops"""
