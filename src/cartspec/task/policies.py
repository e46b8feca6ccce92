"""The shop's support policy table: the only source of gold support replies."""

from __future__ import annotations

from .schema import SupportReply, SupportTopic

POLICIES: dict[SupportTopic, str] = {
    SupportTopic.refund_window: (
        "You can return most items within 30 days of delivery for a full refund to your original payment method."
    ),
    SupportTopic.return_shipping: (
        "Returns are free: print the prepaid label from your orders page and drop the parcel at any carrier location."
    ),
    SupportTopic.payment_methods: (
        "We accept Visa, Mastercard, American Express, PayPal, Apple Pay and gift cards."
    ),
    SupportTopic.shipping_times: (
        "Standard shipping takes 3-5 business days, express takes 1-2 business days, and orders over $50 ship free."
    ),
    SupportTopic.international: (
        "We ship to over 40 countries; international delivery takes 7-14 business days and duties are shown at checkout."
    ),
    SupportTopic.warranty: (
        "Electronics carry a 1-year manufacturer warranty; contact us with your order number to start a claim."
    ),
}

# Replies that depend on an order number given in the question.
ORDER_TEMPLATES: dict[SupportTopic, tuple[str, str]] = {
    # (with order id, without order id)
    SupportTopic.order_status: (
        "Order {order_id} is on its way; the tracking link is on your orders page and in your shipping email.",
        "Please share your order number and I will check its status; you can also track it on your orders page.",
    ),
    SupportTopic.cancel_order: (
        "You can cancel order {order_id} from your orders page until it ships; after that, please return it instead.",
        "You can cancel an order from your orders page until it ships; after that, please return it instead.",
    ),
}


def support_reply(topic: SupportTopic, order_id: str | None = None) -> SupportReply:
    """The gold reply for a topic (and order number, where the topic uses one)."""
    if topic in ORDER_TEMPLATES:
        with_id, without_id = ORDER_TEMPLATES[topic]
        text = with_id.format(order_id=order_id) if order_id else without_id
        return SupportReply(topic=topic, order_id=order_id, reply=text)
    return SupportReply(topic=topic, reply=POLICIES[topic])
