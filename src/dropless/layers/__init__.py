"""dropless.layers"""
