"""dropless.distributed"""
