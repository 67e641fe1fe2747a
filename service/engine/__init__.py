"""What a request goes through: queue, scheduler, the step, verification, sampling."""
