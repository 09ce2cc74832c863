from __future__ import annotations

import factory

from workqueue.models import Subscription, Topic, Transport


class TransportFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Transport
        django_get_or_create = ("name",)

    name = "Database"
    driver_class = "Database"


class TopicFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Topic

    name = factory.Sequence(lambda n: f"test.topic-{n}")
    transport = factory.SubFactory(TransportFactory)


class SubscriptionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Subscription

    name = factory.Sequence(lambda n: f"test.sub-{n}")
    topic = factory.SubFactory(TopicFactory)
    handler_key = "tests.noop"
