"""What an engine reports about itself: acceptance statistics per request, tag, length bucket and
window with their Prometheus text (metrics), and the healthy ranges those are judged against
(health). Pure Python records, below everything that produces or serves them."""
